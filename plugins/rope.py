"""rope: stretch rotary positions (linear interpolation, NTK, dynamic NTK, YaRN).

Uses transformers' own RoPE initialisers: the method swaps the model's rotary
embedding module for one built from a copy of the config with new
``rope_parameters`` and puts the original back on detach.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

from lcx.adapters import families
from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.method import Method, option


@dataclass
class Rope(Method):
    name = "rope"
    description = "position interpolation / NTK / YaRN through the model's rope parameters"
    requires = frozenset({"rotary"})
    lora_roles = ("q", "k")
    serving = "config"
    reads_past_window = True

    type: Literal["linear", "ntk", "dynamic", "yarn"] = option("yarn", "scaling rule: linear (PI), ntk (static NTK-aware base), dynamic (dynamic NTK), yarn")
    factor: float | str = option("auto", "context extension factor: new window = factor x trained window (a rope the model already stretches, of the same type: stretched that much further); auto: each request's own length / the trained window, at least 1 (lcx serve: --max-model-len / the window; lcx train: --seq-len / the window)")

    def __post_init__(self) -> None:
        if self.factor != "auto" and (isinstance(self.factor, str) or self.factor < 1.0):
            raise ValueError(f"factor must be a number >= 1 or auto, got {self.factor!r}")
        if self.type not in ("linear", "ntk", "dynamic", "yarn"):
            raise ValueError(f"type must be linear, ntk, dynamic or yarn, got {self.type!r}")
        self._rotary = None  # (parent module, attribute, the model's own rotary embedding) once attached
        self._installed = 1.0  # the factor the model's rotary embedding now stretches by

    def factor_for(self, window: int, tokens: int) -> float:
        """The factor a request of ``tokens`` tokens (prompt + new) runs with on a model of ``window``."""
        if self.factor != "auto":
            return float(self.factor)
        return max(1.0, math.ceil(4 * tokens / window) / 4)  # quarter steps: prompts of about one length share one table

    def scaled_parameters(self, params: dict, window: int, head_dim: int, factor: float | None = None) -> dict:
        """New rope parameters for one attention type.  Parameters already scaled (a model trained with a
        stretched rope, e.g. Llama 3.1's llama3 or a linear x2) are stretched further when they are of this
        method's type (factors multiply, the original length stays) and refused otherwise: replacing them
        would move every position the model was trained on, and can shrink what it reads.  ``factor``: this
        method's own unless given (factor=auto has none of its own)."""
        factor = float(self.factor) if factor is None else factor
        have = params.get("rope_type") or params.get("type") or "default"
        new = {k: v for k, v in params.items() if k != "type"}  # vLLM refuses a legacy `type` beside `rope_type`
        if have != "default":
            if have == self.type and self.type in ("linear", "dynamic", "yarn"):
                new["rope_type"] = have
                new["factor"] = float(params.get("factor") or 1.0) * factor
                return new
            how = (f"-o rope.type={have} stretches it by a further factor" if have in ("linear", "dynamic", "yarn")
                   else "lcx's rope cannot stretch that kind further; use the model without rope")
            raise LcxError(f"rope: the model's rotary embedding is already scaled ({have}, factor {params.get('factor')}); "
                           f"rope type={self.type} would replace that scaling, not extend it ({how})")
        if self.type == "ntk":  # NTK-aware: raise the base so the lowest frequency stretches by `factor`
            new["rope_theta"] = params["rope_theta"] * factor ** (head_dim / max(head_dim - 2, 1))
            new["rope_type"] = "default"
        else:
            new["rope_type"] = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn"}[self.type]
            new["factor"] = factor
            new["original_max_position_embeddings"] = window
        return new

    def fix_length(self, window: int, tokens: int) -> None:
        if self.factor == "auto":
            self.factor = self.factor_for(window, tokens)

    def resolved(self, config: dict) -> dict:
        if self.factor != "auto":
            return {"factor": float(self.factor)}
        window = families.json_window(config)
        return {"factor": f"per request: its tokens / {window:,} (the window), in quarter steps, at least 1"}

    def check_serving(self) -> None:
        if self.factor == "auto":
            raise LcxError("rope: factor=auto follows the longest request, but none was given; vLLM serves one rope "
                           "for every request: give --max-model-len N (the longest prompt + answer to serve; the "
                           "factor is N / the model's window) or -o rope.factor=F")

    def vllm_config(self, config: dict) -> dict:
        """config.json with the stretched rope parameters baked in: vLLM builds the same rotary
        embedding (its maximum length, factor x window, is passed as --max-model-len: vLLM does not
        derive it for YaRN, whose max_position_embeddings it takes as already stretched).  The parameters
        and the window are read as transformers reads them on lcx's own path (a legacy ``rope_scaling``
        included, e.g. Llama 3.x's llama3 rope: its original length is the window), and ``rope_scaling`` is
        dropped: loaders take it over ``rope_parameters``."""
        if config.get("model_type") == "phi3":  # vLLM reads a phi3 rope as longrope only (short/long factors)
            raise LcxError(f"rope: vLLM cannot serve a phi3 model with {self.type} rope (it accepts only phi3's "
                           "longrope scaling); use lcx generate, or serve it without rope")
        cfg = families.json_config(config)
        out = {k: v for k, v in config.items() if k != "rope_scaling"}
        window = families.config_window(cfg)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        params = dict(cfg.rope_parameters or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)})
        if "rope_theta" in params:
            out["rope_parameters"] = self.scaled_parameters(params, window, int(head_dim * params.get("partial_rotary_factor", 1.0)))
        else:  # per-layer-type parameters (gemma3): stretch the full-attention layers only
            params["full_attention"] = self.scaled_parameters(params["full_attention"], window, head_dim)
            out["rope_parameters"] = params
        return out

    def reach(self, run, tokens: int, new: int, span: tuple[int, int]) -> tuple[bool, str]:
        factor = self.factor_for(run.window, tokens + new)
        stretched = int(factor * run.window)
        if tokens + new <= stretched:
            return True, f"positions stretched x{factor:g}: all {tokens:,} tokens fit its {stretched:,}-token window"
        return False, (f"positions stretched x{factor:g} to {stretched:,} tokens: the prompt's {tokens:,} go past "
                       "them, to positions the model never saw")

    def request_options(self) -> dict:
        return {"factor": self._installed} if self.factor == "auto" and self._rotary is not None else {}

    def begin_request(self, run, tokens: int, new: int) -> None:
        if self.factor == "auto":
            self._install(run, self.factor_for(run.window, tokens + new))

    @hookimpl
    def lcx_patch_model(self, run, model):
        fam = run.family
        parent_path, _, attr = fam.rotary.rpartition(".")
        parent = model.get_submodule(parent_path)
        self._rotary = (parent, attr, families.rotary_embedding(model, fam))
        self._installed = 1.0 if self.factor == "auto" else None
        run.patches.callback(setattr, parent, attr, self._rotary[2])
        if self.factor != "auto":
            self._install(run, float(self.factor))
        else:  # stretched per request (begin_request); a rope it cannot stretch is refused now, not mid-request
            self._stretched(run, 2.0)

    def _stretched(self, run, factor: float):
        """A copy of the model's own rotary embedding, stretched by ``factor``."""
        rot = self._rotary[2]
        cfg = copy.deepcopy(rot.config)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        head_dim = int(head_dim * (cfg.rope_parameters.get("partial_rotary_factor", 1.0) if "rope_theta" in cfg.rope_parameters else 1.0))
        if "rope_theta" in cfg.rope_parameters:
            cfg.rope_parameters = self.scaled_parameters(cfg.rope_parameters, run.window, head_dim, factor)
        else:  # per-layer-type parameters (gemma3): stretch the full-attention layers only
            params = dict(cfg.rope_parameters)
            params["full_attention"] = self.scaled_parameters(params["full_attention"], run.window, head_dim, factor)
            cfg.rope_parameters = params
        return type(rot)(config=cfg).to(device=rot.inv_freq.device if hasattr(rot, "inv_freq") else None)

    def _install(self, run, factor: float) -> None:
        """Put the rotary embedding stretched by ``factor`` in the model (with factor=auto, its own one at 1)."""
        if factor == self._installed:
            return
        parent, attr, rot = self._rotary
        setattr(parent, attr, rot if factor == 1.0 and self.factor == "auto" else self._stretched(run, factor))
        self._installed = factor


@hookimpl
def lcx_register_methods(register):
    register(Rope)
