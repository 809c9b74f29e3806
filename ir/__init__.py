"""The IR core, the bottom layer: values, placements, ops and programs (``core``), mesh axis roles (``axes``),
placement arithmetic (``layout``), the printer, the parser and the verifier. It imports nothing of autopar but
``errors``."""
