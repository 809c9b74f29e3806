"""The papers' closed-form pipeline bubble ratios (and Merak's sub-pipelined tensor-parallel cost),
each with the assumptions it is stated under.

Three definitions are in use (``autopar.schedule.simulator`` computes each):

- Megatron / Merak: bubble time / ideal computation time (``SimResult.bubble_ratio``).
- Chimera / Hanayo: bubble time / total time (``SimResult.idle_fraction``).
- Zero Bubble (ZB-H2, ZB-V): the idle time inside each rank's own span / ideal computation time
  (``SimResult.span_bubble``), the bubble when consecutive steps overlap (the paper's optimizer
  post-validation).

The zero-bubble forms are bubble *times* in T_F, T_B (input gradients only) and T_W (weight
gradients) of one microbatch on one stage; ``tb`` below is T_B, not the whole backward.

``paper_bubble(name, P, M, **options)`` returns ``(value, definition, formula)`` for a registered
schedule, or ``None`` where the paper gives no formula for that configuration.
"""

from __future__ import annotations

from fractions import Fraction

MEGATRON = "bubble / compute"
HANAYO = "bubble / total"
SPAN = "span bubble / compute"


def one_f_one_b(p: int, m: int) -> Fraction:
    """GPipe and 1F1B, Megatron 2.2.1: (p-1)/m; equal stages, no transfer time, any t_b/t_f."""
    return Fraction(p - 1, m)


def interleaved(p: int, m: int, v: int) -> Fraction:
    """Megatron 2.2.2: (p-1)/(v m), v chunks of t_f/v and t_b/v, m a multiple of p."""
    return Fraction(p - 1, v * m)


def early_recompute(s: int, m: int) -> Fraction:
    """Merak 5.1, 1F1B + early recomputation: 3(s-1)/(4m), T_R = T_F, T_B = 2 T_F."""
    return Fraction(3 * (s - 1), 4 * m)


def shifted_critical_path(s: int, m: int) -> Fraction:
    """Merak 5.1: 3(s-2)/(4m), T_R = T_F, T_B = 2 T_F, full recomputation but on the last stage."""
    return Fraction(3 * (s - 2), 4 * m)


def hanayo(p: int, w: int) -> Fraction:
    """Hanayo Eq. (1) at T_B = 2 T_F, T_C = 0: (2P-2)/(3PW+P-1); its figures use M = P.

    Read against the simulator it is bubble / (compute + bubble / 2): docs/schedules.md.
    """
    return Fraction(2 * p - 2, 3 * p * w + p - 1)


def sub_pipelined_tp(tm: Fraction | float, ta: Fraction | float, k: int) -> tuple:
    """Merak 5.3: the cost of one microbatch through K transformer layers under tensor parallelism,
    ``(default, sub_pipelined)``. ``tm``: a layer's forward compute, ``ta``: its forward communication
    (two all-reduces); the backward costs ``2 tm`` and ``ta``; attention and FFN blocks weigh the same.

    default (3T_m + 2T_a)K; sub-pipelined (two sub-microbatches, one communicating while the other
    computes) 1/4 T_m + (K-1/4) max{T_m, T_a} + 1/4 T_a forward plus 1/2 T_m + (K-1/4) max{2T_m, T_a}
    + 1/4 T_a backward, which is 3/4 T_m + 1/2 T_a + (K-1/4) max{3T_m, 2T_m+T_a, 2T_a}.
    """
    q = Fraction(1, 4) if isinstance(tm, Fraction) and isinstance(ta, Fraction) else 0.25
    default = (3 * tm + 2 * ta) * k
    sub = 3 * q * tm + 2 * q * ta + (k - q) * max(3 * tm, 2 * tm + ta, 2 * ta)
    return default, sub


def sub_pipelined_tp_phases(tm: Fraction | float, ta: Fraction | float, k: int) -> tuple:
    """Merak 5.3's sub-pipelined forward and backward costs, ``(forward, backward)``, as the paper
    states them before summing (``sum == sub_pipelined_tp(...)[1]``)."""
    q = Fraction(1, 4) if isinstance(tm, Fraction) and isinstance(ta, Fraction) else 0.25
    forward = q * tm + (k - q) * max(tm, ta) + q * ta
    backward = 2 * q * tm + (k - q) * max(2 * tm, ta) + q * ta
    return forward, backward


def zb_h1(p: int, tf: Fraction, tb: Fraction, tw: Fraction) -> Fraction:
    """Zero Bubble 2.3, Table 2, ZB-H1: (p-1)(T_F + T_B - T_W), step time minus compute.

    Holds exactly for m >= p when T_W <= min(T_F, T_B) (the paper's transformer has T_W < T_F < T_B);
    the simulator gives (p-1)(T_F + T_B - min(T_F, T_B, T_W)) for every m >= p.
    """
    return (p - 1) * (tf + tb - tw)


def zb_h2(p: int, tf: Fraction, tb: Fraction, tw: Fraction) -> Fraction:
    """Zero Bubble 2.3, Table 2, ZB-H2: (p-1)(T_F + T_B - 2T_W) inside each rank's span (the
    parallelogram of Fig. 3), zero when T_F + T_B = 2 T_W; for m >= 2p - 1 when T_W <= T_F and
    2 T_W <= T_F + T_B."""
    return (p - 1) * (tf + tb - 2 * tw)


def dualpipev_equal(p: int, t: Fraction) -> Fraction:
    """DeepSeek-V3 Table 2 (DualPipe, and DualPipeV on half the devices): (PP/2-1)(F&B + B - 3W) with
    B the whole backward. Here p ranks hold PP = 2p stages; at T_F = T_B = T_W = t per chunk, F&B read
    as T_F + T_B (nothing overlaps, as the issue states it) and B = T_B + T_W, this is (p-1) t, step
    time minus compute and inside each span alike, for m >= 2p. (Read with F&B = the forward plus the
    whole backward it is 2(p-1) t, which the schedule beats.)"""
    return (p - 1) * t


def paper_bubble(name: str, p: int, m: int, **options: int | Fraction) -> tuple[Fraction, str, str] | None:
    """The paper's value for a schedule as ``make_schedule(name, p, m, **options)`` builds it."""
    if name in ("gpipe", "1f1b") and not options.get("recompute"):
        return one_f_one_b(p, m), MEGATRON, "(p-1)/m"
    if name == "1f1b":
        return early_recompute(p, m), MEGATRON, "3(s-1)/(4m)"
    if name == "interleaved" and m % p == 0:
        return interleaved(p, m, int(options.get("chunks", 2))), MEGATRON, "(p-1)/(vm)"
    if name == "scp" and m >= 3 and not options.get("alpha1"):
        return shifted_critical_path(p, m), MEGATRON, "3(s-2)/(4m)"
    if name == "wave" and m == p:
        return hanayo(p, int(options.get("waves", 1))), HANAYO, "(2P-2)/(3PW+P-1)"
    return _zero_bubble(name, p, m)


def _zero_bubble(name: str, p: int, m: int) -> tuple[Fraction, str, str] | None:
    """The zero-bubble schedules' values at T_F = T_B = T_W (``Costs``' default split of T_B = 2 T_F):
    a rank's share computes 3 units per microbatch; V schedules split it over two chunks."""
    one = Fraction(1)
    if name == "zb-h1" and m >= p:
        return zb_h1(p, one, one, one) / (3 * m), MEGATRON, "(p-1)(T_F+T_B-T_W)"
    if name == "zb-h2" and m >= 2 * p - 1:
        return zb_h2(p, one, one, one) / (3 * m), SPAN, "(p-1)(T_F+T_B-2T_W)"
    if name == "zbv" and m >= 2 * p - 1:  # Zero Bubble 6: zero inside each span at T_F = T_B = T_W
        return Fraction(0), SPAN, "0 at T_F=T_B=T_W"
    if name == "dualpipev" and m >= 2 * p:
        return dualpipev_equal(p, one / 2) / (3 * m), MEGATRON, "(PP/2-1)(F&B+B-3W)"
    return None
