"""``mtpserve convert`` and ``mtpserve extract-head``: quantized trunks that keep their MTP head.

mlx-lm's own conversion drops every ``mtp.*`` tensor, so mlx-community 4/8-bit
folders have no head. Here the head travels as a *sidecar*: ``mtp.safetensors`` next to the
trunk's weights, named in the folder's ``config.json`` under ``loader.SIDECAR_CONFIG_KEY``.

* ``convert --model SRC --out DIR [--bits 4|8|16] [--group-size 64] [--head-bits 4|8|16]``:
  the trunk goes through mlx-lm's own ``load_model`` / ``quantize_model`` / ``save_model`` /
  ``save_config`` (so DIR is a normal mlx-lm folder; ``--bits 16`` keeps it unquantized), the
  tokenizer files and ``generation_config.json`` are copied verbatim, and the head is read from
  only the shards the index says hold ``mtp.*``.
* ``extract-head --model SRC --into DIR [--head-bits ...]``: add the head of an original
  checkpoint (folder or repo id; for a repo id only the index, config and the shards holding
  ``mtp.*`` are downloaded) to an already converted folder. The head is built against DIR's own
  trunk configuration and refused, with the differences named, when it does not fit.

Sidecar format: tensors named ``mtp.<MTPHead parameter path>`` (already mapped by
``loader.sanitize_head``: MoE experts stacked into ``switch_mlp``), norms already shifted (+1,
metadata ``mtpserve.norms_shifted = "true"``), 16-bit parts (``fc``, norms, MoE routers) in
bfloat16, the decoder layer's linears quantized (affine, ``mtpserve.quantization`` =
``{"group_size", "bits"}``) unless ``--head-bits 16``. Loading goes through ``engine.model.loader``,
which reads that metadata.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.model import loader
from engine.model.mtp import MTPHead

log = logging.getLogger("mtpserve.convert")

SIDECAR_NAME = "mtp.safetensors"
SIDECAR_QUANTIZATION = "mtpserve.quantization"
INDEX_NAME = "model.safetensors.index.json"
HEAD_BITS = (4, 8, 16)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}
#: Text-config fields that must agree between the checkpoint a head comes from and the trunk.
ARCH_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "attn_output_gate",
    "tie_word_embeddings",
)
#: Files never copied from the source folder into a converted one.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")


class ConvertError(ValueError):
    """A refused conversion; the message says why and what to do."""


# -- reading a head --------------------------------------------------------------------------


def mtp_shards(index: dict[str, Any]) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` says hold ``mtp.*`` tensors."""
    return sorted({f for k, f in index["weight_map"].items() if loader.MTP_KEY.match(k)})


def download_head_files(
    repo_id: str, revision: str | None = None, download: Callable[..., str] | None = None
) -> tuple[dict[str, Any], list[Path]]:
    """Download a repo's config and only the weight files that hold ``mtp.*`` tensors.

    ``download`` is ``huggingface_hub.hf_hub_download`` (injectable for tests).
    """
    if download is None:
        from huggingface_hub import hf_hub_download as download
    from huggingface_hub import errors

    # Only "the repo has no such file"; offline / not-cached errors propagate as they are.
    missing = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)

    def fetch(name: str) -> Path:
        return Path(download(repo_id=repo_id, filename=name, revision=revision))

    config = json.loads(fetch("config.json").read_text())
    if sidecar := config.get(loader.SIDECAR_CONFIG_KEY):  # a folder this tool converted
        return config, [fetch(sidecar)]
    try:
        index = json.loads(fetch(INDEX_NAME).read_text())
    except missing:
        log.info("%s has no %s: downloading model.safetensors", repo_id, INDEX_NAME)
        return config, [fetch("model.safetensors")]
    names = mtp_shards(index)
    log.info(
        "downloading %d of %d shards of %s (those holding mtp.*)",
        len(names),
        len(set(index["weight_map"].values())),
        repo_id,
    )
    return config, [fetch(name) for name in names]


def _is_local(model: str) -> bool:
    path = Path(model).expanduser()
    return path.is_dir() or path.exists() or model.startswith((".", "/", "~"))


def source_head_files(model_dir: Path, config: dict[str, Any]) -> list[Path]:
    """A local checkpoint's files holding the head: its sidecar, else the shards with mtp.*."""
    if sidecar := config.get(loader.SIDECAR_CONFIG_KEY):
        return [model_dir / sidecar]
    return loader._files_holding_mtp(model_dir)


def read_head(files: list[Path]) -> tuple[dict[str, mx.array], bool]:
    """(raw head tensors, whether their norms still need the +1). Quantized layers carry their
    bits and group size in their shapes (``loader.quantization_from_shapes``).

    Only ``mtp.*`` tensors are read (lazily); other tensors in the same files stay on disk.
    """
    tensors, metadata = loader.read_mtp_tensors(files)
    return tensors, loader.head_norms_zero_centred(tensors, metadata)


# -- building and writing a sidecar ----------------------------------------------------------


def build_head(args: Any, tensors: dict[str, mx.array], shift: bool) -> MTPHead:
    """An ``MTPHead`` for trunk ``args`` loaded (strictly) with the given tensors, dequantized."""
    from mlx_lm.utils import dequantize_model

    holder = SimpleNamespace(language_model=SimpleNamespace(args=args))
    head = loader.attach_head(holder, tensors, shift)  # strict shape check
    if any(k.endswith(".scales") for k in tensors):
        dequantize_model(head)
    return head


def head_quant_predicate(group_size: int) -> Callable[[str, nn.Module], bool]:
    """The decoder layer's linears; ``fc``, norms and MoE routers stay 16-bit."""

    def predicate(path: str, module: nn.Module) -> bool:
        if not hasattr(module, "to_quantized") or path == "fc":
            return False
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            return False
        return module.weight.shape[-1] % group_size == 0

    return predicate


def write_sidecar(
    head: MTPHead,
    path: Path,
    *,
    head_bits: int,
    group_size: int,
    dtype: mx.Dtype = mx.bfloat16,
    source: str = "",
) -> dict[str, Any]:
    """Quantize ``head`` (in place) to ``head_bits`` and save it; returns a summary."""
    head.set_dtype(dtype)
    metadata = {"format": "mlx", loader.SIDECAR_NORMS_SHIFTED: "true"}
    if source:
        metadata["mtpserve.source"] = source
    if head_bits != 16:
        nn.quantize(
            head,
            group_size=group_size,
            bits=head_bits,
            class_predicate=head_quant_predicate(group_size),
        )
        metadata[SIDECAR_QUANTIZATION] = json.dumps({"group_size": group_size, "bits": head_bits})
    weights = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.eval(weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), weights, metadata=metadata)
    quantized = sorted({k.rsplit(".", 1)[0] for k in weights if k.endswith(".scales")})
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "tensors": len(weights),
        "quantized_layers": len(quantized),
        "bits": head_bits,
    }


def trunk_args(model_dir: Path, config: dict[str, Any]) -> Any:
    """The trunk's ``TextModelArgs`` from its config (no weights are read)."""
    model_class, args_class = loader._model_classes(config)
    return model_class(args_class.from_dict(config)).language_model.args


def check_architecture(
    head_config: dict[str, Any], trunk_config: dict[str, Any], what: str
) -> None:
    """Refuse a head whose checkpoint differs from the trunk's in architecture."""
    head_tc = head_config.get("text_config", head_config)
    trunk_tc = trunk_config.get("text_config", trunk_config)
    problems = []
    head_type, trunk_type = head_config.get("model_type", ""), trunk_config.get("model_type", "")
    if head_type not in loader.SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {head_type!r} is not a Qwen3.5/3.6 model")
    elif ("moe" in head_type) != ("moe" in trunk_type):
        problems.append(f"model_type {head_type!r} (head) vs {trunk_type!r} (trunk)")
    for key in ARCH_KEYS:
        a, b = head_tc.get(key, head_config.get(key)), trunk_tc.get(key, trunk_config.get(key))
        if a is not None and b is not None and a != b:
            problems.append(f"{key} {a} (head) vs {b} (trunk)")
    if problems:
        raise ConvertError(f"{what}: the head does not match the trunk: " + "; ".join(problems))


# -- convert -----------------------------------------------------------------------------------


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name == "config.json":
            continue
        if f.name.endswith(WEIGHT_SUFFIXES) or f.name.endswith(".index.json"):
            continue
        shutil.copy2(f, dst / f.name)
        copied.append(f.name)
    return copied


def convert(
    model: str,
    out: Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    head_bits: int = 8,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """Quantize the trunk with mlx-lm into ``out`` and write the head as a sidecar there."""
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    if bits not in (4, 8, 16) or head_bits not in HEAD_BITS:
        raise ConvertError("--bits and --head-bits must be 4, 8 or 16")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"{out} exists and is not empty; choose a new --out folder")
    src = loader.resolve_model_dir(model)
    raw_config = json.loads((src / "config.json").read_text())
    if "quantization" in raw_config or "quantization_config" in raw_config:
        raise ConvertError(
            f"{model} is already quantized; convert from the original checkpoint, or add a head "
            "to this folder with `mtpserve extract-head`"
        )
    net, _ = load_model(src, lazy=True, get_model_classes=loader._model_classes)
    target = DTYPES[dtype]
    cast = getattr(net, "cast_predicate", lambda _: True)
    net.update(
        tree_map_with_path(
            lambda k, v: v.astype(target) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            net.parameters(),
        )
    )
    config = dict(raw_config)
    if bits != 16:
        net, config = quantize_model(net, config, group_size, bits)

    # The head first: a head that does not fit refuses before anything is written.
    head_files = source_head_files(src, raw_config)
    tensors, shift = read_head(head_files)
    head_summary = None
    if tensors:
        try:
            head = build_head(net.language_model.args, tensors, shift)
        except ValueError as exc:
            raise ConvertError(f"the MTP head of {model} does not load: {exc}") from exc
    else:
        head = None
        log.warning("%s has no mtp.* tensors: the converted folder has no MTP head", model)

    out.mkdir(parents=True, exist_ok=True)
    save_model(out, net, donate_model=True)
    copied = _copy_side_files(src, out)
    if head is not None:
        head_summary = write_sidecar(
            head,
            out / SIDECAR_NAME,
            head_bits=head_bits,
            group_size=group_size,
            dtype=target,
            source=str(model),
        )
        config[loader.SIDECAR_CONFIG_KEY] = SIDECAR_NAME
    save_config(config, out / "config.json")
    trunk_bytes = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    return {
        "out": str(out),
        "trunk_bits": bits,
        "group_size": group_size,
        "trunk_bytes": trunk_bytes,
        "head": head_summary,
        "head_read_from": [f.name for f in head_files],
        "copied": copied,
    }


# -- extract-head ------------------------------------------------------------------------------


def _folder_has_head(folder: Path, config: dict[str, Any]) -> str | None:
    if sidecar := config.get(loader.SIDECAR_CONFIG_KEY):
        return f"its config names the sidecar {sidecar}"
    if loader.read_mtp_tensors(loader._files_holding_mtp(folder))[0]:
        return "its weights hold mtp.* tensors"
    return None


def extract_head(
    model: str,
    into: Path,
    *,
    head_bits: int = 8,
    group_size: int | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
    revision: str | None = None,
    download: Callable[..., str] | None = None,
) -> dict[str, Any]:
    """Add the MTP head of checkpoint ``model`` to the converted folder ``into``."""
    if head_bits not in HEAD_BITS:
        raise ConvertError("--head-bits must be 4, 8 or 16")
    into = Path(into)
    if not (into / "config.json").exists():
        raise ConvertError(f"{into} is not a model folder (no config.json)")
    trunk_config = json.loads((into / "config.json").read_text())
    if (why := _folder_has_head(into, trunk_config)) and not force:
        raise ConvertError(f"{into} already has an MTP head ({why}); pass --force to replace it")

    if _is_local(model):
        src: Path | None = loader.resolve_model_dir(model)
        head_config = json.loads((src / "config.json").read_text())
        files = source_head_files(src, head_config)
    else:
        src = None
        head_config, files = download_head_files(model, revision, download)
    check_architecture(head_config, trunk_config, f"{model} -> {into}")
    tensors, shift = read_head(files)
    if not tensors:
        raise ConvertError(
            f"{model} has no mtp.* tensors (read {', '.join(f.name for f in files)})"
        )
    try:
        head = build_head(trunk_args(into, trunk_config), tensors, shift)
    except ValueError as exc:
        raise ConvertError(
            f"the MTP head of {model} does not fit the trunk in {into}: {exc}"
        ) from exc

    if group_size is None:
        group_size = int((trunk_config.get("quantization") or {}).get("group_size", 64))
    summary = write_sidecar(
        head,
        into / SIDECAR_NAME,
        head_bits=head_bits,
        group_size=group_size,
        dtype=DTYPES[dtype],
        source=str(model),
    )
    trunk_config[loader.SIDECAR_CONFIG_KEY] = SIDECAR_NAME
    (into / "config.json").write_text(json.dumps(trunk_config, indent=4) + "\n")
    summary["read_from"] = [f.name for f in files]
    return summary


# -- command line --------------------------------------------------------------------------------


def _bits(value: str) -> int:
    bits = int(value)
    if bits not in (4, 8, 16):
        raise argparse.ArgumentTypeError("must be 4, 8 or 16")
    return bits


def cmd_convert(args: argparse.Namespace) -> int:
    return _report(
        lambda: convert(
            args.model,
            Path(args.out),
            bits=args.bits,
            group_size=args.group_size,
            head_bits=args.head_bits,
            dtype=args.dtype,
        )
    )


def cmd_extract_head(args: argparse.Namespace) -> int:
    return _report(
        lambda: extract_head(
            args.model,
            Path(args.into),
            head_bits=args.head_bits,
            group_size=args.group_size,
            dtype=args.dtype,
            force=args.force,
            revision=args.revision,
        )
    )


def _report(work: Callable[[], dict[str, Any]]) -> int:
    """Run a command's work: print its summary as JSON (exit 0) or its error (exit 2)."""
    try:
        summary = work()
    except (ConvertError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "convert", help="quantize the trunk with mlx-lm; keep the MTP head as a sidecar"
    )
    p.add_argument("--model", required=True, help="original checkpoint: HF repo id or folder")
    p.add_argument("--out", required=True, help="new folder for the converted model")
    p.add_argument("--bits", type=_bits, default=4, help="trunk bits: 4, 8 or 16 (not quantized)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument(
        "--head-bits",
        type=_bits,
        default=8,
        help="bits of the head's decoder-layer linears (fc and norms stay 16-bit)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="dtype of everything not quantized",
    )
    p.set_defaults(func=cmd_convert)

    e = sub.add_parser(
        "extract-head", help="add the MTP head of an original checkpoint to a converted folder"
    )
    e.add_argument(
        "--model",
        required=True,
        help="original checkpoint (repo id: only the shards holding mtp.* download)",
    )
    e.add_argument("--into", required=True, help="converted folder (e.g. an mlx-community model)")
    e.add_argument("--head-bits", type=_bits, default=8)
    e.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="default: the folder's own quantization group size, else 64",
    )
    e.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    e.add_argument("--revision", default=None, help="with a repo id: branch, tag or commit")
    e.add_argument("--force", action="store_true", help="replace an existing head")
    e.set_defaults(func=cmd_extract_head)
