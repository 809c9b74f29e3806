"""Sharding rules by op family: what each op allows on one mesh axis."""
