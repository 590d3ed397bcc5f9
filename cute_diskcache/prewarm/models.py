"""From a model name to the per-rank MoE shape a serving engine hands flashinfer.

Models are resolved the way an operator names them: a local directory or ``config.json``, a
Hugging Face repo id (read from the local HF cache first, so it works offline on a build box
that already pulled the weights), or the short name of a config bundled with this package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """The config cannot be read or lacks a field; the message names the field."""


class UnsupportedModelError(ValueError):
    """The model is readable but flashinfer's sm12x MoE path cannot serve it; says why."""


@dataclass(frozen=True)
class MoEShape:
    """One rank's fused-MoE problem, in B12xMoEWrapper's terms."""

    model: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per rank, after tensor parallelism
    num_local_experts: int  # per rank, after expert parallelism
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_beta: float = 1.0
    swiglu_limit: float | None = None
    quant_mode: str = "nvfp4"
    num_layers: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def bundled() -> list[str]:
    """Short names of the configs shipped with the package."""
    folder = resources.files("cute_diskcache.prewarm") / "model_configs"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_config(model: str) -> tuple[dict[str, Any], str]:
    """Return (config dict, where it came from) for a path, a bundled name or an HF repo id."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _read_json(path), str(path)
    if model.lower() in bundled():
        res = resources.files("cute_diskcache.prewarm") / "model_configs" / f"{model.lower()}.json"
        return json.loads(res.read_text()), f"bundled:{model.lower()}"
    if "/" in model:
        return _read_json(Path(_hf_config(model))), f"hf:{model}"
    raise ModelConfigError(
        f"model {model!r} is not a directory, a config.json, a Hugging Face repo id or a bundled name "
        f"({', '.join(bundled())})"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return data


def _hf_config(repo_id: str) -> str:
    """config.json of a repo: the local HF cache first (offline build boxes), then the Hub."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:
        raise ModelConfigError(f"resolving the repo id {repo_id!r} needs huggingface_hub>=0.25 ({exc}): "
                               "pip install 'cute-diskcache[prewarm]', or give a local directory / config.json") from None
    try:
        return str(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - malformed repo ids and the like
        raise ModelConfigError(f"cannot resolve {repo_id!r}: {exc}") from None
    try:
        return str(hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # noqa: BLE001 - the Hub client raises many kinds; each becomes the user's one error
        raise ModelConfigError(f"{repo_id!r} is not in the local Hugging Face cache and the Hub said: {exc}") from None


def _first(cfg: dict[str, Any], names: tuple[str, ...], what: str, model: str) -> Any:
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    raise ModelConfigError(f"{model}: config has no {what} (looked for {' / '.join(names)})")


def _int_field(cfg: dict[str, Any], names: tuple[str, ...], what: str, model: str) -> int:
    value = _first(cfg, names, what, model)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{model}: {what} ({names[0]}) must be a positive integer, got {value!r}")
    return value


def _quant_mode(cfg: dict[str, Any], model: str) -> str:
    """nvfp4 or w4a16 from the checkpoint's quantization_config; anything else is unservable."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "unquantized"
        raise UnsupportedModelError(
            f"{model}: the checkpoint is {dtype} (no quantization_config); flashinfer's sm12x fused-MoE "
            "kernels run NVFP4 (or W4A16 FP4) weights only. Prewarm the NVFP4 checkpoint instead "
            "(e.g. nvidia/Qwen3-30B-A3B-NVFP4)."
        )
    method = str(q.get("quant_method", "")).lower()
    algo = str(q.get("quant_algo", q.get("format", ""))).lower()
    if method == "modelopt" and algo == "nvfp4":
        return "nvfp4"
    if method == "modelopt" and algo in ("w4a16_nvfp4", "nvfp4_w4a16"):
        return "w4a16"
    if method == "compressed-tensors" and "nvfp4" in json.dumps(q).lower():
        return "nvfp4"
    raise UnsupportedModelError(
        f"{model}: quantization {method or '?'}/{algo or '?'} is not served by flashinfer's sm12x fused-MoE "
        "path (it takes ModelOpt or compressed-tensors NVFP4)."
    )


def moe_shape(model: str, *, tp: int = 1, ep: int = 1) -> MoEShape:
    """Per-rank MoE shape: TP shards the intermediate size, EP shards the experts."""
    cfg, source = load_config(model)
    name = source
    if tp < 1 or ep < 1:
        raise ModelConfigError("--tp and --ep must be >= 1")
    num_experts = _int_field(cfg, ("num_experts", "num_local_experts", "n_routed_experts"), "expert count", name)
    top_k = _int_field(cfg, ("num_experts_per_tok", "experts_per_token", "moe_topk"), "experts per token", name)
    hidden = _int_field(cfg, ("hidden_size",), "hidden size", name)
    inter = _int_field(cfg, ("moe_intermediate_size", "intermediate_size"), "MoE intermediate size", name)
    quant = _quant_mode(cfg, name)
    if inter % tp:
        raise UnsupportedModelError(f"{name}: MoE intermediate size {inter} does not split over tp={tp}")
    if num_experts % ep:
        raise UnsupportedModelError(f"{name}: {num_experts} experts do not split over ep={ep}")
    notes: list[str] = []
    activation, limit = "silu", None
    if cfg.get("model_type") == "gpt_oss":
        # gpt-oss's clamped SwiGLU (alpha 1.702, beta 1, limit from the config), as vLLM maps it.
        activation, limit = "swigluoai_uninterleave", float(cfg.get("swiglu_limit", 7.0))
        notes.append("gpt-oss activation: swigluoai_uninterleave (alpha 1.702, beta 1.0)")
    elif str(cfg.get("hidden_act", "silu")) not in ("silu", "swiglu"):
        act = str(cfg.get("hidden_act"))
        if act in ("relu2", "gelu_tanh", "gelu_pytorch_tanh"):
            activation = "gelu_tanh" if act.startswith("gelu") else "relu2"
        else:
            raise UnsupportedModelError(f"{name}: activation {act!r} has no sm12x fused-MoE kernel")
    return MoEShape(
        model=name,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=inter // tp,
        num_local_experts=num_experts // ep,
        activation=activation,
        swiglu_limit=limit,
        quant_mode=quant,
        num_layers=cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else None,
        notes=notes,
    )


# --------------------------------------------------------------------------------------------
# Dense layers: the linear shapes an engine runs through flashinfer's b12x FP4 GEMM
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """One NVFP4 linear layer of one rank, as the GEMM sees it (vLLM pads n and k to 32)."""

    name: str  # qkv_proj, o_proj, gate_up_proj, down_proj, shared_expert.gate_up_proj, ...
    n: int  # output features of this rank
    k: int  # input features of this rank

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "n": self.n, "k": self.k}


#: vLLM's ``--dtype`` values an NVFP4 linear can run in, and the GEMM output dtype each means.
ACTIVATION_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class DenseShape:
    """One rank's NVFP4 linear layers: what vLLM's ``FlashInferB12xNvFp4LinearKernel`` runs.

    Every layer of a kind has the same shape, so each kind is listed once. ``out_dtype`` is the
    activations' dtype (vLLM passes ``x.dtype`` as the GEMM's output dtype).
    """

    model: str
    linears: tuple[Linear, ...]
    out_dtype: str = "bfloat16"
    quant_mode: str = "nvfp4"
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "linears": [lin.as_dict() for lin in self.linears], "out_dtype": self.out_dtype,
                "quant_mode": self.quant_mode, "notes": list(self.notes)}

    def with_dtype(self, dtype: str | None) -> DenseShape:
        """These layers under the engine's ``--dtype`` (vLLM's activation dtype, which its NVFP4
        linears, flashinfer's and b12x's, pass as the GEMM's output dtype: another kernel);
        ``auto`` (or None) keeps the checkpoint's. The CLI offers only what vLLM serves them in."""
        if dtype in (None, "auto"):
            return self
        if dtype not in ACTIVATION_DTYPES:
            raise UnsupportedModelError(f"--dtype {dtype}: the NVFP4 linears' output is one of {', '.join(ACTIVATION_DTYPES)}")
        return replace(self, out_dtype=ACTIVATION_DTYPES[dtype])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DenseShape:
        return cls(model=d["model"], linears=tuple(Linear(**lin) for lin in d["linears"]), out_dtype=d["out_dtype"],
                   quant_mode=d["quant_mode"], notes=tuple(d.get("notes", ())))


#: vLLM's ``pad_nvfp4_weight_for_cutlass``: both weight dims (n rows, k elements) to a multiple of 32.
_PAD = 32


def _pad(v: int) -> int:
    return -(-v // _PAD) * _PAD


def is_moe(cfg: dict[str, Any]) -> bool:
    """Whether the config describes a mixture-of-experts model (it names an expert count)."""
    return any(isinstance(cfg.get(k), int) and cfg[k] > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def _excluded(cfg: dict[str, Any]) -> list[str]:
    """Module name patterns the checkpoint leaves unquantized (ModelOpt ``exclude_modules``,
    compressed-tensors ``ignore``)."""
    q = cfg.get("quantization_config") or {}
    out = []
    for key in ("exclude_modules", "ignore", "modules_to_not_convert"):
        value = q.get(key)
        if isinstance(value, list):
            out += [str(v) for v in value]
    return out


def _quantized(module: str, excluded: list[str]) -> bool:
    """Whether layer 0's ``module`` (e.g. ``self_attn.q_proj``) is NVFP4 in the checkpoint."""
    import fnmatch

    name = f"model.layers.0.{module}"
    for pattern in excluded:
        if pattern.startswith("re:"):
            import re

            if re.search(pattern[3:], name):
                return False
        elif fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*{pattern}") or name.endswith(f".{pattern}"):
            return False
    return True


def _linear_layers(cfg: dict[str, Any], name: str, tp: int) -> list[tuple[str, tuple[str, ...], int, int]]:
    """Layer 0's linear layers of one rank, each as (label, the checkpoint's module names, n, k),
    sharded as vLLM shards them (column-parallel outputs, row-parallel inputs, KV heads replicated
    when there are fewer than ranks), unpadded."""
    hidden = _int_field(cfg, ("hidden_size",), "hidden size", name)
    heads = _int_field(cfg, ("num_attention_heads",), "attention head count", name)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % tp:
        raise UnsupportedModelError(f"{name}: {heads} attention heads do not split over tp={tp}")
    kv_rank = max(1, kv_heads // tp)  # fewer KV heads than ranks: each rank holds a replica
    candidates: list[tuple[str, tuple[str, ...], int, int]] = [
        ("qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj"),
         (heads // tp + 2 * kv_rank) * head_dim, hidden),
        ("o_proj", ("self_attn.o_proj",), hidden, heads * head_dim // tp),
    ]
    mlps: list[tuple[str, str, int]] = []  # (label prefix, module, intermediate size)
    if not is_moe(cfg):
        mlps.append(("", "mlp", _int_field(cfg, ("intermediate_size",), "intermediate size", name)))
    else:
        shared = cfg.get("shared_expert_intermediate_size") or (
            (cfg.get("n_shared_experts") or 0) * (cfg.get("moe_intermediate_size") or 0))
        if shared:
            mlps.append(("shared_expert.", "mlp.shared_expert", int(shared)))
        if cfg.get("mlp_only_layers") or cfg.get("first_k_dense_replace"):
            mlps.append(("dense_mlp.", "mlp", _int_field(cfg, ("intermediate_size",), "dense MLP intermediate size", name)))
    for label, module, inter in mlps:
        if inter % tp:
            raise UnsupportedModelError(f"{name}: intermediate size {inter} does not split over tp={tp}")
        candidates += [
            (f"{label}gate_up_proj", (f"{module}.gate_proj", f"{module}.up_proj", f"{module}.gate_up_proj"), 2 * inter // tp, hidden),
            (f"{label}down_proj", (f"{module}.down_proj",), hidden, inter // tp),
        ]
    return candidates


def dense_shape(model: str, *, tp: int = 1) -> DenseShape:
    """Per-rank NVFP4 linear shapes, as vLLM shards them (column-parallel outputs, row-parallel
    inputs, KV heads replicated when there are fewer than ranks) and pads them (to 32).

    A MoE model's dense layers are its attention projections, plus shared experts and the dense
    MLP layers some architectures keep (``shared_expert_intermediate_size``, ``mlp_only_layers``,
    ``first_k_dense_replace``). Layers the checkpoint leaves unquantized are not listed.
    Raises :class:`UnsupportedModelError` for a checkpoint without NVFP4 linear layers.
    """
    cfg, name = load_config(model)
    if tp < 1:
        raise ModelConfigError("--tp must be >= 1")
    quant = _quant_mode(cfg, name)
    if quant != "nvfp4":
        raise UnsupportedModelError(f"{name}: {quant} linear layers do not run through flashinfer's b12x FP4 GEMM")
    excluded = _excluded(cfg)
    candidates = _linear_layers(cfg, name, tp)
    notes: list[str] = []
    linears = []
    for label, modules, n, k in candidates:
        if not all(_quantized(m, excluded) for m in modules):
            notes.append(f"{label} left unquantized by the checkpoint (not a b12x GEMM)")
            continue
        linears.append(Linear(label, _pad(n), _pad(k)))
    torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    out_dtype = "float16" if torch_dtype in ("float16", "half") else "bfloat16"
    return DenseShape(model=name, linears=tuple(linears), out_dtype=out_dtype, quant_mode=quant, notes=tuple(notes))


#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: an LM head's rows are the vocabulary padded to 64, split over the ranks.
_VOCAB_PAD = 64


def unquantized_linears(model: str, *, tp: int = 1) -> tuple[tuple[Linear, ...], tuple[str, ...]]:
    """(layers, notes): the per-rank weight shapes (n, k), unpadded, of the layers vLLM may hand its
    own skinny GEMM (``maybe_use_skinny_gemm``: a 2-D weight the checkpoint leaves unquantized, no
    bias): the linear layers, a MoE model's router (replicated) and the LM head. Biases are read
    from the config as the model families declare them (``attention_bias``, Qwen2's q/k/v bias,
    ``mlp_bias``, gpt-oss's router)."""
    cfg, name = load_config(model)
    cfg = cfg.get("text_config") or cfg
    if tp < 1:
        raise ModelConfigError("--tp must be >= 1")
    quantized = bool(cfg.get("quantization_config"))
    excluded = _excluded(cfg)
    biased = {"qkv_proj", "o_proj"} if cfg.get("attention_bias") else set()
    if cfg.get("model_type") in ("qwen2", "qwen2_moe"):
        biased.add("qkv_proj")
    layers, notes = [], []
    for label, modules, n, k in _linear_layers(cfg, name, tp):
        if quantized and all(_quantized(m, excluded) for m in modules):
            continue
        if label in biased or (cfg.get("mlp_bias") and label.endswith(("gate_up_proj", "down_proj"))):
            notes.append(f"{label} has a bias (not a skinny GEMM)")
            continue
        layers.append(Linear(label, n, k))
    hidden = int(cfg["hidden_size"])
    experts = next((cfg[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if isinstance(cfg.get(key), int)), 0)
    if is_moe(cfg) and cfg.get("model_type") != "gpt_oss":
        layers.append(Linear("router", experts, hidden))
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int) and (-(-vocab // _VOCAB_PAD) * _VOCAB_PAD) % tp == 0:
        layers.append(Linear("lm_head", -(-vocab // _VOCAB_PAD) * _VOCAB_PAD // tp, hidden))
    else:
        notes.append("the LM head's shape is not known (the config names no vocab_size that splits over the ranks)")
    return tuple(layers), tuple(notes)
