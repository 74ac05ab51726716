"""An independent slow reference of the Qwen3.5 MTP head, in float64 numpy.

From the head's forward and the HF tensor layout only; it shares no code with ``engine/``. It
reads the raw checkpoint tensors itself (zero-centred norms applied as 1 + w, q_proj emitting
[query | gate] per head, partial rotary embedding) and recomputes every pair from scratch for
each cycle, attending over all earlier positions without any cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class ReferenceHead:
    def __init__(self, model_dir: Path) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.cfg = config.get("text_config", config)
        self.w: dict[str, np.ndarray] = {}
        for f in sorted(model_dir.glob("model*.safetensors")):
            for k, v in load_file(str(f)).items():
                self.w[k] = v.astype(np.float64)
        self.embed = self.w["model.language_model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)
        self.eps = self.cfg["rms_norm_eps"]

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(var + self.eps) * (1.0 + self.w[name])

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        hd = x.shape[-1]
        rd = int(hd * self.cfg["rope_parameters"]["partial_rotary_factor"])
        theta = self.cfg["rope_parameters"]["rope_theta"]
        inv = theta ** (-np.arange(0, rd, 2) / rd)
        ang = positions[:, None] * inv[None]  # [T, rd/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return np.concatenate([rotated, x[..., rd:]], axis=-1)

    def layer(self, z: np.ndarray) -> np.ndarray:
        """The head's decoder layer over positions 0..T-1 (causal, no cache)."""
        p = "mtp.layers.0."
        c = self.cfg
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        t = z.shape[0]
        x = self.norm(z, p + "input_layernorm.weight")
        qg = (x @ self.w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nh * hd)
        k = (x @ self.w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd)
        v = (x @ self.w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
        q = self.norm(q, p + "self_attn.q_norm.weight")
        k = self.norm(k, p + "self_attn.k_norm.weight")
        pos = np.arange(t, dtype=np.float64)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        scores = scores + np.triu(np.full((t, t), -np.inf), 1)[None]
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", attn, v).reshape(t, nh * hd)
        o = o / (1.0 + np.exp(-gate)) * 1.0
        h = z + o @ self.w[p + "self_attn.o_proj.weight"].T
        x = self.norm(h, p + "post_attention_layernorm.weight")
        return h + self.mlp(x, p + "mlp.")

    def mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        def silu(a: np.ndarray) -> np.ndarray:
            return a / (1.0 + np.exp(-a))

        if p + "gate_proj.weight" in self.w:
            g, u = x @ self.w[p + "gate_proj.weight"].T, x @ self.w[p + "up_proj.weight"].T
            return (silu(g) * u) @ self.w[p + "down_proj.weight"].T
        router = x @ self.w[p + "gate.weight"].T
        probs = np.exp(router - router.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = self.cfg["num_experts_per_tok"]
        gate_up, down = self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"]
        mid = gate_up.shape[1] // 2
        out = np.zeros_like(x)
        for i in range(x.shape[0]):
            chosen = np.argsort(-probs[i])[:top]
            weights = probs[i, chosen] / probs[i, chosen].sum()
            for e, wgt in zip(chosen, weights, strict=True):
                gu = gate_up[e] @ x[i]
                out[i] += wgt * (down[e] @ (silu(gu[:mid]) * gu[mid:]))
        shared = silu(x @ self.w[p + "shared_expert.gate_proj.weight"].T) * (
            x @ self.w[p + "shared_expert.up_proj.weight"].T
        )
        shared = shared @ self.w[p + "shared_expert.down_proj.weight"].T
        sg = 1.0 / (1.0 + np.exp(-(x @ self.w[p + "shared_expert_gate.weight"].T)))
        return out + sg * shared

    def step_logits(self, hidden: np.ndarray, tokens: list[int]) -> np.ndarray:
        """Head logits for the token after ``tokens`` (pairs t = 0..len-2, no drafts yet)."""
        o = self._run(list(hidden[: len(tokens) - 1]), list(tokens[1:]))
        return o[-1] @ self.lm_head.T

    def _run(self, states: list[np.ndarray], inputs: list[int]) -> np.ndarray:
        e = self.norm(self.embed[np.array(inputs)], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(np.stack(states), "mtp.pre_fc_norm_hidden.weight")
        z = np.concatenate([e, h], axis=-1) @ self.w["mtp.fc.weight"].T
        return self.norm(self.layer(z), "mtp.norm.weight")

    def drafts(self, hidden: np.ndarray, tokens: list[int], k: int) -> list[int]:
        """Greedy drafts after ``tokens`` given trunk states ``hidden[t]`` for t < len-1.

        Pairs (h_t, x_{t+1}) for t = 0..len-2, then k-1 more steps feeding the head's own
        post-norm output and its previous draft.
        """
        states = list(hidden[: len(tokens) - 1])
        inputs = list(tokens[1:])
        out: list[int] = []
        for _ in range(k):
            o = self._run(states, inputs)
            d = int(np.argmax(o[-1] @ self.lm_head.T))
            out.append(d)
            states.append(o[-1])
            inputs.append(d)
        return out
