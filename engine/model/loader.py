"""Load a Qwen3.5/3.6 checkpoint once and attach its MTP head in place.

* ``--model`` is a local folder or a Hugging Face repo id (downloaded through huggingface_hub;
  never in tests or the default ``make serve``).
* The trunk loads through mlx-lm (its ``sanitize`` handles raw HF vs mlx-converted weights and
  drops every ``mtp.*`` tensor, so the lazily-mapped head tensors are never read there).
* The head's tensors are found through ``model.safetensors.index.json`` (or by scanning the
  single file / a sidecar), read lazily from only the shards that hold them, and loaded into an
  ``MTPHead`` set as ``language_model.mtp``: one model object, one copy of every weight.
* The +1 shift of zero-centred norms is applied to the head exactly once: per the sidecar's own
  metadata, else as the head's own norm weights show (raw HF stores them zero-centred, near 0;
  an mlx conversion stores 1 + w, near 1). Never from the trunk's folder: a head extracted by
  hand from an HF shard may sit beside an mlx-converted trunk.
* A quantized head needs no metadata: each layer's bits and group size follow from its packed
  weight's and its scales' shapes.
* A head the engine cannot run (more than one MTP layer, dedicated head embeddings) is left out
  with one warning: the model serves plain decoding.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.utils import load_model

from engine.model import memory, norms, products
from engine.model.location import resolve_model_dir
from engine.model.mlx_products import product_parts
from engine.model.mtp import MTPHead

log = logging.getLogger("mtpserve.loader")

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
MTP_KEY = re.compile(r"^(?:model\.)?(?:language_model\.)?mtp\.(.+)$")
#: Metadata key a sidecar written by ``mtpserve convert`` carries.
SIDECAR_NORMS_SHIFTED = "mtpserve.norms_shifted"
#: config.json key naming the sidecar in a converted folder.
SIDECAR_CONFIG_KEY = "mtpserve_mtp_weights"
ZERO_CENTRED_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


@dataclass
class LoadedModel:
    model: nn.Module  # mlx-lm Model; the head (if any) is ``model.language_model.mtp``
    config: dict[str, Any]
    model_dir: Path
    head_source: str | None  # where the head came from, None when there is none
    head_missing_reason: str | None

    @property
    def trunk(self) -> Any:
        return self.model.language_model

    @property
    def head(self) -> MTPHead | None:
        return getattr(self.trunk, "mtp", None)

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config)


def _model_classes(config: dict[str, Any]) -> tuple[type, type]:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not a Qwen3.5/3.6 text model "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    # mlx-lm's qwen3_5 module covers dense and MoE, nested and flat configs (the MoE module only
    # adds fused-expert renaming, which ``_sanitize_moe`` below does for both).
    if model_type.startswith("qwen3_5_moe"):
        from mlx_lm.models import qwen3_5_moe

        return qwen3_5_moe.Model, qwen3_5_moe.ModelArgs
    return qwen3_5.Model, qwen3_5.ModelArgs


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("model*.safetensors"))


def _files_holding_mtp(model_dir: Path) -> list[Path]:
    """Only the shards the index says hold ``mtp.*`` tensors (all files without an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = sorted({f for k, f in weight_map.items() if MTP_KEY.match(k)})
        return [model_dir / n for n in names]
    return _weight_files(model_dir)


#: mean norm weight below which a head's norms are taken as zero-centred (raw HF): trained
#: zero-centred weights sit near 0, their mlx-shifted form near 1
ZERO_CENTRED_BELOW = 0.5


def head_norms_zero_centred(tensors: dict[str, mx.array], metadata: dict[str, str]) -> bool:
    """Whether the head's norm weights still need the +1 (raw HF convention).

    The file's own metadata decides when it has ours; otherwise the weights do: the mean of the
    head's RMSNorm weights is near 0 when stored zero-centred and near 1 when shifted.
    """
    if SIDECAR_NORMS_SHIFTED in metadata:
        return metadata[SIDECAR_NORMS_SHIFTED] != "true"
    means = [
        v.astype(mx.float32).mean().item()
        for k, v in tensors.items()
        if v.ndim == 1 and k.endswith(ZERO_CENTRED_NORMS)
    ]
    if not means:
        return False
    middle = sorted(means)[len(means) // 2]
    if 0.25 < middle < 0.75:
        log.warning(
            "MTP head norm weights average %.2f: cannot tell raw-HF (near 0) from mlx-shifted "
            "(near 1) for sure; taking them as %s",
            middle,
            "raw HF" if middle < ZERO_CENTRED_BELOW else "shifted",
        )
    return middle < ZERO_CENTRED_BELOW


def unsupported_head(text_config: dict[str, Any], tensors: dict[str, mx.array]) -> str | None:
    """Why the engine cannot run this head (None when it can): it runs one full-attention MTP
    layer sharing the trunk's embedding and output projection."""
    layers = int(text_config.get("mtp_num_hidden_layers", 1) or 1)
    layers = max(
        layers,
        1
        + max(
            (int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))), default=0
        ),
    )
    if layers > 1:
        return f"the head has {layers} MTP layers (mtp_num_hidden_layers); the engine runs one"
    own = sorted(k for k in tensors if k.startswith(("embed_tokens.", "lm_head.", "shared_head.")))
    if text_config.get("mtp_use_dedicated_embeddings") or own:
        return "the head has dedicated embeddings; the engine shares the trunk's"
    return None


def quantization_from_shapes(
    head: nn.Module, weights: dict[str, mx.array]
) -> Callable[[str, nn.Module], bool | dict[str, int]]:
    """``nn.quantize`` predicate: each layer with ``scales`` quantized at the bits and group size
    its shapes imply (packed uint32 width = in * bits / 32, scales width = in / group size)."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_features = module.weight.shape[-1]
        packed = weights[f"{path}.weight"].shape[-1]
        return {"group_size": in_features // scales.shape[-1], "bits": packed * 32 // in_features}

    return predicate


def read_mtp_tensors(files: list[Path]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The ``mtp.*`` tensors (prefix stripped) and the files' metadata; other tensors unread."""
    tensors: dict[str, mx.array] = {}
    metadata: dict[str, str] = {}
    for f in files:
        arrays, meta = mx.load(str(f), return_metadata=True)
        metadata.update(meta or {})
        for k, v in arrays.items():
            if match := MTP_KEY.match(k):
                tensors[match.group(1)] = v
    return tensors, metadata


def sanitize_head(weights: dict[str, mx.array], shift_norms: bool) -> dict[str, mx.array]:
    """Map checkpoint head tensors onto ``MTPHead`` parameter names."""
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for key, value in weights.items():
        if shift_norms and value.ndim == 1 and key.endswith(ZERO_CENTRED_NORMS):
            value = value + 1.0
        if m := re.match(r"layers\.0\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", key):
            experts.setdefault(m.group(2), {})[int(m.group(1))] = value
            continue
        if key.endswith("mlp.experts.gate_up_proj"):
            mid = value.shape[-2] // 2
            out["layers.0.mlp.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out["layers.0.mlp.switch_mlp.up_proj.weight"] = value[..., mid:, :]
            continue
        if key.endswith("mlp.experts.down_proj"):
            out["layers.0.mlp.switch_mlp.down_proj.weight"] = value
            continue
        out[key] = value
    for proj, by_index in experts.items():
        out[f"layers.0.mlp.switch_mlp.{proj}_proj.weight"] = mx.stack(
            [by_index[i] for i in sorted(by_index)]
        )
    return out


def attach_head(model: nn.Module, weights: dict[str, mx.array], shift_norms: bool) -> MTPHead:
    """Build the head, load its weights and set it as ``model.language_model.mtp``."""
    trunk = model.language_model
    head = MTPHead(trunk.args)
    named = sanitize_head(weights, shift_norms)
    if any(k.endswith(".scales") for k in named):
        # Bits and group size from the shapes: sidecars of other tools carry no metadata of ours.
        nn.quantize(head, class_predicate=quantization_from_shapes(head, named))
    head.load_weights(list(named.items()), strict=True)
    head.eval()
    trunk.mtp = head
    return head


def load(
    model: str,
    *,
    mtp_weights: str | None = None,
    dtype: str = "auto",
    with_head: bool = True,
    prepare: Callable[[nn.Module], None] | None = None,
    memory_limit: int | None = None,
    ranks: int = 1,
) -> LoadedModel:
    """Load the trunk and attach the head. ``dtype`` auto keeps the stored dtype on GPUs and on
    CPUs that run the native product kernel, and uses fp32 on other CPUs where it fits
    (``engine.model.memory.plan``; ``memory_limit`` bytes stands for the memory available).
    Refuses with ``InsufficientMemory`` before reading any weight when nothing fits. The model
    is loaded lazily and ``prepare`` (e.g. shard: engine.distributed) runs before any weight is
    read, so only what is left after it is read from disk; each tensor is read and cast once
    (evaluated in batches), so loading never holds a second copy of the weights. ``ranks``: the
    memory plan is for one rank's shard of that many."""
    model_dir = resolve_model_dir(model)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config = json.loads(config_path.read_text())
    files = _weight_files(model_dir)
    if sidecar := (mtp_weights if with_head else None) or config.get(SIDECAR_CONFIG_KEY):
        path = Path(sidecar).expanduser()
        path = path if path.exists() else model_dir / path
        files += [path] if path.exists() else []
    size = memory.checkpoint_size(files).per_rank(ranks)
    on_cpu = mx.default_device() == mx.cpu
    # with the native kernel, half-precision and quantized weights stay as stored on a CPU
    chosen = memory.plan(size, dtype, on_cpu, memory_limit, widen_on_cpu=not products.on_native())
    log.info(
        "loading %s: %.2f GB of weights in %s (stored as %s; %.1f GB available)",
        model_dir.name,
        chosen.needed / 1e9,
        chosen.dtype,
        size.stored_dtype,
        chosen.available / 1e9,
    )
    t0 = time.perf_counter()
    net, config = load_model(model_dir, lazy=True, get_model_classes=_model_classes)

    target = None if chosen.dtype == size.stored_dtype and dtype == "auto" else chosen.dtype
    target = getattr(mx, target) if target else None
    if prepare is not None:
        prepare(net)  # before the cast: a slice of a stored tensor is cast, not the whole tensor
    if target is not None:
        net.set_dtype(target)  # floating parameters only; packed quantized weights stay

    head_source, reason = None, None
    if with_head:
        head_source, reason = _load_head(net, model_dir, config, mtp_weights, target)
    _materialise(net, chosen.needed)
    # one rank per machine's cores: ranks sharing a machine would each split across all of them
    products.prepare(net, product_parts() if ranks == 1 else 1)
    norms.prepare(net)
    log.info("weights loaded in %.1fs; %s", time.perf_counter() - t0, products.description())
    if reason:
        log.warning("no MTP head: %s; serving plain decoding", reason)
    memory.configure_device(chosen.needed)
    return LoadedModel(net, config, model_dir, head_source, reason)


#: bytes evaluated at a time while loading (at most; a 32nd of the weights on smaller models):
#: bounds what a cast holds twice, and paces progress. Evaluated all at once, a bf16 checkpoint
#: widened to fp32 peaked at 1.06-1.11x its resident bytes (33 M parameters), in 32 batches 1.02x
LOAD_BATCH_BYTES = 256 * 2**20


def _materialise(net: nn.Module, total: int) -> None:
    """Evaluate the lazily loaded (and cast) parameters a batch at a time, logging progress:
    a tensor's stored copy is freed as soon as its cast is made."""
    from mlx.utils import tree_flatten

    params = [a for _, a in tree_flatten(net.parameters())]
    batch_limit = min(LOAD_BATCH_BYTES, max(total // 32, 2**20))
    t0, done, batch, batch_bytes, next_report = time.perf_counter(), 0, [], 0, 0.25
    for array in params:
        batch.append(array)
        batch_bytes += array.nbytes
        if batch_bytes >= batch_limit or array is params[-1]:
            mx.eval(batch)
            done += batch_bytes
            batch, batch_bytes = [], 0
            if total > 4 * LOAD_BATCH_BYTES and done >= next_report * total:
                log.info(
                    "loaded %.1f of %.1f GB (%.0fs)",
                    done / 1e9,
                    total / 1e9,
                    time.perf_counter() - t0,
                )
                next_report += 0.25


def _load_head(
    net: nn.Module,
    model_dir: Path,
    config: dict[str, Any],
    mtp_weights: str | None,
    target: mx.Dtype | None,
) -> tuple[str | None, str | None]:
    text_config = config.get("text_config", config)
    sidecar = mtp_weights or config.get(SIDECAR_CONFIG_KEY)
    if sidecar:
        path = Path(sidecar).expanduser()
        # A path from config.json is relative to the model folder; an explicit --mtp-weights
        # is relative to the working directory (the model folder as a fallback).
        if not path.is_absolute() and not (mtp_weights and path.exists()):
            path = model_dir / path
        if not path.exists():
            if mtp_weights:  # asked for explicitly: a typo must not silently mean "no MTP"
                raise FileNotFoundError(f"--mtp-weights {mtp_weights!r} does not exist")
            return None, f"MTP sidecar {path} does not exist"
        files = [path]
    else:
        files = _files_holding_mtp(model_dir)
    tensors, metadata = read_mtp_tensors(files)
    if not tensors:
        n = text_config.get("mtp_num_hidden_layers", 0)
        why = "the checkpoint has no mtp.* tensors"
        if n:
            why += f" although config says mtp_num_hidden_layers={n} (converted without the head?"
            why += " see `mtpserve extract-head`)"
        return None, why
    if why := unsupported_head(text_config, tensors):
        return None, why
    shift = head_norms_zero_centred(tensors, metadata)
    try:
        head = attach_head(net, tensors, shift)
    except ValueError as exc:
        raise ValueError(f"MTP head in {files[0]} does not match the trunk: {exc}") from exc
    if target is not None:
        head.set_dtype(target)
    return ", ".join(str(f.name) for f in files), None
