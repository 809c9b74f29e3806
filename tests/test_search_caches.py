"""What the search keeps on disk between runs besides profiles and schedules: the V layouts
(``stage_layout.kept_v_layout``), the same as computing them, read back, a damaged entry computed again."""

from __future__ import annotations

from autopar.search import stage_layout
from autopar.search.stage_layout import balanced_v_layout, kept_v_layout


def test_a_kept_v_layout_is_the_computed_one_and_is_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "plans"))
    w = [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    want = balanced_v_layout(w, 2)
    assert kept_v_layout(w, 2) == want and kept_v_layout(w, 5) == balanced_v_layout(w, 5)
    assert kept_v_layout(w, 6) is None  # more stages than units, kept too
    files = sorted((tmp_path / "layouts").glob("v-2-*.json"))
    assert len(files) == 1
    calls = []
    monkeypatch.setattr(stage_layout, "balanced_v_layout", lambda *a: calls.append(a) or want)
    assert kept_v_layout(w, 2) == want and kept_v_layout(w, 6) is None and not calls  # read back, not computed
    assert kept_v_layout([*w[:-1], 2.5], 2) == want and len(calls) == 1  # other FLOPs: another entry
    files[0].write_text("{not json")
    assert kept_v_layout(w, 2) == want and len(calls) == 2  # damaged: computed again


def test_kept_stash_points_are_the_orders_own(tmp_path, monkeypatch):
    """The zero-bubble schedules' stash points the search prices memory with, read back from disk, are what their
    orders give."""
    from autopar.schedule.actions import stash_points
    from autopar.schedule.generators import zero_bubble_orders
    from autopar.search import price

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "plans"))
    wants = {name: [stash_points(o) for o in zero_bubble_orders(name, 3, 7)] for name in price.ZERO_BUBBLE}
    price._points_of.cache_clear()
    for name, want in wants.items():
        assert price._points_of(name, 3, 7) == want  # computed and written
    monkeypatch.setattr(price, "zero_bubble_orders", None)  # not called again
    price._points_of.cache_clear()
    for name, want in wants.items():
        assert price._points_of(name, 3, 7) == want  # read back
    assert len(list((tmp_path / "stash_points").glob("*.json"))) == len(wants) == 4
    price._points_of.cache_clear()
