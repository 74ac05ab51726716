"""Quantized trunks with an MTP head sidecar: convert, extract-head and loading them.

Round trip: convert (trunk 4/8 bit x head 4/8/16 bit) -> load -> greedy K=1..3 equals K=0 of
the same quantized model, token for token. extract-head adds a head to a folder mlx-lm's own
convert wrote without one, reads only the shards holding ``mtp.*`` (download included, with a
fake downloader), and refuses heads that do not fit the trunk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import VARIANTS, Variant

from engine.api import GenerationRequest
from engine.model import convert as conv
from engine.model import loader, products
from engine.runtime import Engine
from sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox"]
TOKENS = 48


def generate(engine: Engine, ids: list[int], k: int) -> tuple[list[int], object]:
    request = GenerationRequest(
        prompt_ids=ids, sampling=GREEDY, max_tokens=TOKENS, draft_tokens=k, ignore_eos=True
    )
    tokens: list[int] = []
    event = None
    for event in engine.generate(request):
        tokens += event.token_ids
    return tokens, event.stats


def assert_speculative_equals_plain(
    engine: Engine, ks: tuple[int, ...] = (1, 2, 3)
) -> tuple[int, int]:
    proposed = accepted = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain, _ = generate(engine, ids, 0)
        assert len(plain) == TOKENS
        for k in ks:
            spec, stats = generate(engine, ids, k)
            assert spec == plain, f"K={k} diverged from K=0"
            proposed += stats.proposed
            accepted += stats.accepted
    return proposed, accepted


def quantized_bits(module: nn.Module) -> set[int]:
    return {
        m.bits for _, m in module.named_modules() if hasattr(m, "bits") and hasattr(m, "scales")
    }


@pytest.fixture(scope="module")
def converted(make_checkpoint, tmp_path_factory):
    """Convert (once per module) a variant at (bits, head_bits); returns the folder."""
    cache: dict[tuple, Path] = {}

    def make(variant: str | Variant, bits: int, head_bits: int) -> Path:
        v = VARIANTS[variant] if isinstance(variant, str) else variant
        key = (v, bits, head_bits)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{v.name}-{bits}-{head_bits}") / "model"
            conv.convert(str(make_checkpoint(v)), out, bits=bits, head_bits=head_bits)
            cache[key] = out
        return cache[key]

    return make


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("head_bits", [4, 8, 16])
def test_round_trip_greedy_speculative_equals_plain(converted, bits: int, head_bits: int) -> None:
    out = converted("dense-tied", bits, head_bits)
    engine = Engine.load(str(out), draft_tokens=0)
    assert engine.has_head, engine.loaded.head_missing_reason
    assert quantized_bits(engine.trunk.model) == {bits}
    head = engine.loaded.head
    assert quantized_bits(head) == (set() if head_bits == 16 else {head_bits})
    assert isinstance(head.fc, nn.Linear) and not hasattr(head.fc, "scales")  # fc stays 16-bit
    proposed, accepted = assert_speculative_equals_plain(engine)
    assert 0 < accepted < proposed  # the quantized head drafts, and both paths run


@pytest.mark.skipif(not products.on_native(), reason="the native kernel runs on a CPU only")
@pytest.mark.parametrize(
    ("variant", "bits"), [("dense-tied", 4), ("dense-tied", 8), ("moe-tied", 8)]
)
def test_layers_laid_out_for_the_kernel_decode_exactly(
    converted, variant: str, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4- and 8-bit layers laid out for the kernel (``products.interleave_layers``; on this
    CPU's instruction set whichever it is) keep speculative decoding token-identical to plain:
    the tied embedding looked up and projected, the MoE block's shared expert called by mlx-lm's
    own code, the head's layers."""
    monkeypatch.setattr(products, "INTERLEAVED_ISAS", (products.native().isa(),))
    engine = Engine.load(str(converted(variant, bits, bits)), draft_tokens=0)
    laid_out = {
        type(m) for _, m in engine.loaded.model.named_modules() if type(m) in products._LAID_OUT
    }
    assert laid_out == set(products._LAID_OUT)
    proposed, accepted = assert_speculative_equals_plain(engine)
    assert 0 < accepted < proposed


@pytest.mark.skipif(not products.on_native(), reason="the native kernel runs on a CPU only")
def test_a_quantized_prompt_leaves_the_same_caches_however_its_chunks_split(converted) -> None:
    """A prompt's products of 4-bit weights (on AMX tiles another path than decoding's) are
    the same bits for every chunk size, so the caches do not depend on where chunks split;
    decoding first compiles its blocks of 3 and 5 positions, which a prompt's chunks of 3 and 5
    must not reuse."""
    from test_engine import assert_prefill_splits_alike

    engine = Engine.load(str(converted("dense-tied", 4, 4)), draft_tokens=0)
    for k in (2, 4):
        request = GenerationRequest([5, 9, 2], GREEDY, 8, draft_tokens=k, ignore_eos=True)
        list(engine.generate(request))
    assert_prefill_splits_alike(engine)


@pytest.mark.fast
def test_sharded_moe_reads_only_mtp_shards(make_checkpoint, tmp_path, monkeypatch) -> None:
    src = make_checkpoint(VARIANTS["moe-untied-sharded"])
    index = json.loads((src / conv.INDEX_NAME).read_text())
    opened: list[str] = []
    real = loader.read_mtp_tensors

    def spy(files):
        opened.extend(f.name for f in files)
        return real(files)

    monkeypatch.setattr(loader, "read_mtp_tensors", spy)
    summary = conv.convert(str(src), tmp_path / "q", bits=4, head_bits=8)
    assert opened == conv.mtp_shards(index) == ["model-00002-of-00002.safetensors"]
    assert summary["head"]["quantized_layers"] > 0
    monkeypatch.undo()

    engine = Engine.load(str(tmp_path / "q"), draft_tokens=0)
    assert engine.has_head
    head = engine.loaded.head
    assert not hasattr(head.layers[0].mlp.gate, "scales")  # routers stay 16-bit
    assert hasattr(head.layers[0].mlp.switch_mlp.gate_proj, "scales")
    proposed, accepted = assert_speculative_equals_plain(engine, ks=(1, 2))
    assert accepted > 0


def test_sidecar_layout_and_norms_shifted_once(converted, load_engine) -> None:
    out = converted("dense-tied", 4, 8)
    config = json.loads((out / "config.json").read_text())
    assert config[loader.SIDECAR_CONFIG_KEY] == conv.SIDECAR_NAME
    assert config["quantization"]["bits"] == 4
    # A normal mlx-lm folder: tokenizer and generation config copied verbatim.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).exists()
    tensors, meta = mx.load(str(out / conv.SIDECAR_NAME), return_metadata=True)
    assert meta[loader.SIDECAR_NORMS_SHIFTED] == "true"
    assert json.loads(meta[conv.SIDECAR_QUANTIZATION]) == {"group_size": 64, "bits": 8}
    assert all(k.startswith("mtp.") for k in tensors)
    assert tensors["mtp.fc.weight"].dtype == mx.bfloat16 and "mtp.fc.scales" not in tensors
    assert tensors["mtp.norm.weight"].dtype == mx.bfloat16
    assert "mtp.layers.0.self_attn.q_proj.scales" in tensors
    # Only mtp.* left the source: the trunk files hold none.
    for f in out.glob("model*.safetensors"):
        assert not any(loader.MTP_KEY.match(k) for k in mx.load(str(f)))

    # Norms: +1 applied exactly once (compare with the head loaded from the original).
    original = load_engine("dense-tied", draft_tokens=0).loaded.head
    quantized = Engine.load(str(out), draft_tokens=0).loaded.head
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        a, b = getattr(original, name).weight, getattr(quantized, name).weight
        assert mx.allclose(a, b.astype(mx.float32), atol=1e-2).item(), name
    assert mx.allclose(original.fc.weight, quantized.fc.weight.astype(mx.float32), atol=1e-2).item()


def test_unquantized_head_has_no_quantization_metadata(converted) -> None:
    _, meta = mx.load(str(converted("dense-tied", 8, 16) / conv.SIDECAR_NAME), return_metadata=True)
    assert conv.SIDECAR_QUANTIZATION not in meta


@pytest.mark.fast
def test_convert_refuses_nonempty_out_and_quantized_source(
    converted, make_checkpoint, tmp_path
) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(conv.ConvertError, match="not empty"):
        conv.convert(str(make_checkpoint(VARIANTS["dense-tied"])), tmp_path / "x")
    with pytest.raises(conv.ConvertError, match="already quantized"):
        conv.convert(str(converted("dense-tied", 4, 8)), tmp_path / "y")


# -- extract-head ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def headless(make_checkpoint, tmp_path_factory) -> Path:
    """A 4-bit folder written by mlx-lm's own convert (as mlx-community's): no MTP head."""
    from mlx_lm.convert import convert as mlx_lm_convert

    src = make_checkpoint(VARIANTS["dense-tied"])
    out = tmp_path_factory.mktemp("headless") / "model"
    mlx_lm_convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=64)
    return out


def copy_folder(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def test_extract_head_makes_mtp_available(make_checkpoint, headless, tmp_path) -> None:
    folder = copy_folder(headless, tmp_path / "m")
    before = loader.load(str(folder))
    assert before.head is None and "extract-head" in before.head_missing_reason

    src = make_checkpoint(VARIANTS["dense-tied"])
    summary = conv.extract_head(str(src), folder, head_bits=8)
    assert summary["read_from"] == ["model.safetensors"]
    engine = Engine.load(str(folder), draft_tokens=0)
    assert engine.has_head and quantized_bits(engine.loaded.head) == {8}
    proposed, accepted = assert_speculative_equals_plain(engine)
    assert 0 < accepted < proposed

    with pytest.raises(conv.ConvertError, match="already has an MTP head"):
        conv.extract_head(str(src), folder)
    conv.extract_head(str(src), folder, head_bits=4, force=True)
    assert quantized_bits(loader.load(str(folder)).head) == {4}


def test_extract_head_from_a_converted_folder(converted, headless, tmp_path) -> None:
    """A quantized sidecar as the source: dequantized, then written at the new bits."""
    folder = copy_folder(headless, tmp_path / "m")
    summary = conv.extract_head(str(converted("dense-tied", 4, 8)), folder, head_bits=16)
    assert summary["read_from"] == [conv.SIDECAR_NAME]
    engine = Engine.load(str(folder), draft_tokens=0)
    assert engine.has_head and quantized_bits(engine.loaded.head) == set()
    proposed, accepted = assert_speculative_equals_plain(engine, ks=(1, 2))
    assert accepted > 0


def test_mtp_weights_points_at_a_sidecar(converted, headless, tmp_path, monkeypatch) -> None:
    sidecar = converted("dense-tied", 4, 8) / conv.SIDECAR_NAME
    loaded = loader.load(str(headless), mtp_weights=str(sidecar))
    assert loaded.head is not None and quantized_bits(loaded.head) == {8}
    # A relative --mtp-weights is relative to the working directory.
    monkeypatch.chdir(sidecar.parent)
    assert loader.load(str(headless), mtp_weights=conv.SIDECAR_NAME).head is not None
    # A sidecar of another model is refused when loading, not silently misused.
    wide = converted(Variant("wide", hidden=128, intermediate=256, head_dim=32), 4, 8)
    with pytest.raises(ValueError, match="does not match the trunk"):
        loader.load(str(headless), mtp_weights=str(wide / conv.SIDECAR_NAME))
    # A path that does not exist is an error, not a silent fall-back to plain decoding.
    with pytest.raises(FileNotFoundError, match="--mtp-weights"):
        loader.load(str(headless), mtp_weights=str(tmp_path / "typo.safetensors"))


def test_quantized_sidecar_without_our_metadata_loads(converted, headless, tmp_path) -> None:
    """A quantized head written by another tool (no mtpserve metadata): bits and group size
    per layer from the shapes, norms from the weights; it drafts what our own sidecar drafts."""
    ours = converted("dense-tied", 4, 8) / conv.SIDECAR_NAME
    foreign = tmp_path / "foreign-mtp.safetensors"
    mx.save_safetensors(str(foreign), mx.load(str(ours)))  # same tensors, no metadata
    assert not mx.load(str(foreign), return_metadata=True)[1]

    heads = [
        Engine.load(str(headless), mtp_weights=str(f), draft_tokens=2) for f in (ours, foreign)
    ]
    assert quantized_bits(heads[1].loaded.head) == {8}
    assert heads[1].loaded.head.layers[0].self_attn.q_proj.group_size == 64
    ids = heads[0].tokenizer.encode(PROMPTS[0])
    drafts = []
    for engine in heads:
        trace: list[dict] = []
        request = GenerationRequest(ids, GREEDY, TOKENS, draft_tokens=2, ignore_eos=True)
        for _ in engine.generate(request, trace=trace.append):
            pass
        drafts.append([line["draft"] for line in trace])
    assert drafts[0] == drafts[1]


def test_group_size_32_round_trip(converted, make_checkpoint, tmp_path) -> None:
    """Group 32 quantizes the 32-wide MoE expert down projections too (skipped at 64)."""
    out = tmp_path / "g32"
    conv.convert(
        str(make_checkpoint(VARIANTS["moe-tied"])), out, bits=4, group_size=32, head_bits=4
    )
    engine = Engine.load(str(out), draft_tokens=0)
    down = engine.loaded.head.layers[0].mlp.switch_mlp.down_proj
    assert down.group_size == 32 and down.bits == 4
    proposed, _ = assert_speculative_equals_plain(engine, ks=(1, 2))
    # the head drafted; how many of a random head's drafts the random trunk accepts follows
    # the greedy text, which moves with the products' rounding (mlx's or the native kernel's)
    assert proposed > 0


def snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.suffix == ".json"} | {
        "files": "\n".join(sorted(f.name for f in folder.iterdir())).encode()
    }


def test_extract_head_refuses_mismatches(make_checkpoint, headless, tmp_path) -> None:
    folder = copy_folder(headless, tmp_path / "m")
    before = snapshot(folder)
    wide = make_checkpoint(Variant("wide", hidden=128, intermediate=256, head_dim=32))
    with pytest.raises(conv.ConvertError, match=r"hidden_size 128 \(head\) vs 64 \(trunk\)"):
        conv.extract_head(str(wide), folder)
    with pytest.raises(conv.ConvertError, match="model_type"):
        conv.extract_head(str(make_checkpoint(VARIANTS["moe-tied"])), folder)

    # A config that claims to fit while the tensors do not: the strict load refuses.
    liar = copy_folder(wide, tmp_path / "liar")
    shutil.copy(make_checkpoint(VARIANTS["dense-tied"]) / "config.json", liar / "config.json")
    with pytest.raises(conv.ConvertError, match="does not fit the trunk"):
        conv.extract_head(str(liar), folder)
    assert snapshot(folder) == before  # nothing written on refusal
    assert loader.load(str(folder)).head is None


def test_download_selects_only_mtp_shards(converted, make_checkpoint, headless, tmp_path) -> None:
    from huggingface_hub import errors

    sharded = make_checkpoint(VARIANTS["dense-untied-sharded"])
    requested: list[str] = []

    def fake_download(repo_id: str, filename: str, revision: str | None = None) -> str:
        assert repo_id == "org/model"
        requested.append(filename)
        return str(sharded / filename)

    config, files = conv.download_head_files("org/model", download=fake_download)
    assert requested == ["config.json", conv.INDEX_NAME, "model-00003-of-00003.safetensors"]
    assert [f.name for f in files] == requested[2:] and config["model_type"] == "qwen3_5"

    single = make_checkpoint(VARIANTS["dense-tied"])
    requested.clear()

    def no_index(repo_id: str, filename: str, revision: str | None = None) -> str:
        requested.append(filename)
        if filename == conv.INDEX_NAME:
            missing = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
            raise missing.__new__(missing)
        return str(single / filename)

    folder = copy_folder(headless, tmp_path / "m")
    summary = conv.extract_head("org/model", folder, download=no_index)
    assert requested == ["config.json", conv.INDEX_NAME, "model.safetensors"]
    assert summary["read_from"] == ["model.safetensors"]
    assert loader.load(str(folder)).head is not None

    # A repo this tool converted: only its sidecar downloads.
    ours = converted("dense-tied", 4, 8)
    requested.clear()

    def from_ours(repo_id: str, filename: str, revision: str | None = None) -> str:
        requested.append(filename)
        return str(ours / filename)

    _, files = conv.download_head_files("org/model-4bit", download=from_ours)
    assert requested == ["config.json", conv.SIDECAR_NAME]


@pytest.mark.fast
def test_cli(make_checkpoint, tmp_path, capsys) -> None:
    from mtpserve.cli import main

    src = str(make_checkpoint(VARIANTS["dense-tied"]))
    assert (
        main(
            [
                "convert",
                "--model",
                src,
                "--out",
                str(tmp_path / "q"),
                "--bits",
                "8",
                "--head-bits",
                "4",
            ]
        )
        == 0
    )
    assert '"trunk_bits": 8' in capsys.readouterr().out
    assert quantized_bits(loader.load(str(tmp_path / "q")).head) == {4}
    assert main(["convert", "--model", src, "--out", str(tmp_path / "q")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["extract-head", "--model", src, "--into", str(tmp_path / "q")]) == 2
    assert "already has an MTP head" in capsys.readouterr().err


def test_quantized_trunk_with_draft_vocab_loads(converted, tmp_path) -> None:
    folder = copy_folder(converted("dense-tied", 4, 8), tmp_path / "m")
    vocab = json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"]
    (folder / "draft_vocab.json").write_text(
        json.dumps({"default_size": vocab // 2, "ids_by_frequency": list(range(vocab))})
    )
    engine = Engine.load(str(folder), draft_tokens=0)
    assert engine.draft_vocab_size < vocab
    assert_speculative_equals_plain(engine, ks=(1, 2))
