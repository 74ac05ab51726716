"""Peak memory with the head attached grows by the head's own bytes (plus its small KV cache and
activations), and loading never holds a second copy of the trunk. Each measurement runs in a
fresh process so peaks do not mix."""

from __future__ import annotations

from checkpoints import Variant

from engine.memory import measure

BIG = Variant("big", hidden=512, layers=8, intermediate=2560, heads=8, kv_heads=2, head_dim=32)
MiB = 2**20


def test_head_adds_only_its_own_bytes(make_checkpoint) -> None:
    model_dir = make_checkpoint(BIG)
    plain, with_head = measure(model_dir, False), measure(model_dir, True)
    params = (plain["trunk_bytes"] + with_head["head_bytes"]) / 4
    assert params >= 30e6, f"checkpoint too small for this test: {params / 1e6:.1f} M parameters"
    assert with_head["proposed"] > 0 and plain["proposed"] == 0
    head = with_head["head_bytes"]
    # Loading: exactly one copy of the trunk (mmap'd lazily, cast in place), plus the head.
    assert plain["load_peak"] <= plain["trunk_bytes"] * 1.01 + 1 * MiB
    assert with_head["load_peak"] - plain["load_peak"] <= head * 1.01 + 1 * MiB
    # Generating: the head's KV cache (64 + 200 positions x 2 x 2 heads x 32 x 4 B = 270 KB)
    # and a few activations on top of the head's weights.
    assert with_head["generate_peak"] - plain["generate_peak"] <= head + 2 * MiB
