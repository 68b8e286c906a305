"""The decoder-only MoE transformer and ``build_model``.

Every family is the same skeleton: embedding, N pre-norm decoder layers
(x + attn(norm(x)), then x + ffn(norm(x))), final norm, LM head. What differs, the family
describes (``describe_layers`` in its folder: each layer's attention, feed-forward block and
norms as data), and ``build_layers`` compiles those descriptions into modules.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.backend.engine import build_layers, native_kernels
from hybridmoe.backend.engine import stored_linear as stored_linear_module
from hybridmoe.backend.models import layer_description
from hybridmoe.backend.plan import decode_path
from hybridmoe.backend.engine.build_layers import Build
from hybridmoe.backend.engine.cpu_decode import DecodeStep
from hybridmoe.backend.engine.decode_experts import triton_available
from hybridmoe.backend.engine.hybrid import HybridOptions, attach
from hybridmoe.backend.engine.kv_cache import PagedCache, Segment, Sequence
from hybridmoe.backend.engine.layers import Linear, RMSNorm
from hybridmoe.backend.engine.native_kernels import Unsupported
from hybridmoe.backend.engine.native_linear import NativeLinear, native_linear
from hybridmoe.backend.engine.stored_linear import StoredLinear, stored_linear
from hybridmoe.backend.engine.stats import ExpertRecorder
from hybridmoe.backend.engine.tensor_parallel import HeadShards, Shards, part
from hybridmoe.backend.formats.weights import WeightSource, checkpoint_kind, missing_tensor, require, text_model_weights
from hybridmoe.backend.errors import ModelUnloadedError, UnsupportedModelError
from hybridmoe.backend.models.families import family_by_name, family_for_config, spec_from_config
from hybridmoe.backend.models.hf_config import HFConfig
from hybridmoe.backend.models.layer_description import Loading
from hybridmoe.backend.models.spec import SLIDING_REWIND_TOKENS, ModelSpec
from hybridmoe.backend.session import Cancelled

Placement = Mapping[int, Collection[int]]


class DecoderLayer(nn.Module):
    def __init__(self, attn_norm: RMSNorm, attn: nn.Module, ffn_norm: RMSNorm, ffn: nn.Module):
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), segments)
        return x + self.ffn(self.ffn_norm(x))


class MoeTransformer(nn.Module):
    """forward(tokens, start_pos) -> float32 logits, with an explicit, block-allocated KV cache.

    One sequence per call: tokens [T] or [1, T]; the logits come back [T, V] or [1, T, V].
    A call appends its tokens at positions start_pos..start_pos+T-1 of a sequence's cache
    (``seq``, default: the model's own ``sequence``) and attends over everything before
    them; passing an earlier start_pos rewinds. ``forward_batch`` runs one token (or a few)
    of several sequences in one pass: the weights are read once for all of them.
    """

    def __init__(self, *, family: str, spec: ModelSpec, config: HFConfig, embed: torch.Tensor | None,
                 embed_stored: StoredLinear | NativeLinear | None, layers: list[DecoderLayer], norm: RMSNorm, lm_head: nn.Module,
                 recorder: ExpertRecorder, placement: dict[int, tuple[int, ...]], device: torch.device,
                 dtype: torch.dtype, max_context: int, cache: PagedCache, max_sequences: int = 1):
        super().__init__()
        self.family = family
        self.spec = spec
        self.config = config
        # The embedding table: a tensor in the compute dtype (``embed``), or (a GGUF's) its blocks
        # as stored, of which a call dequantizes the rows it looks up (``embed_stored``).
        self.embed_stored = embed_stored
        self.register_buffer("embed", embed, persistent=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.stats = recorder
        self.placement = placement
        self.device = device
        self.dtype = dtype
        self.max_context = max_context
        self.cache = cache
        self.max_sequences = max_sequences  # conversations the cache is sized for
        self.sequence = cache.new_sequence()  # what forward() uses when given no sequence
        # Pipeline over several devices: layer index -> the device its stage runs on, for
        # each layer that starts a stage after the first (empty on one device).
        self.boundaries: dict[int, torch.device] = {}
        self.cards: list[torch.device] = []  # tensor parallelism: the cards every layer is split across
        self.scheduler = None  # the hybrid.HybridScheduler shared by the MoE layers, if any
        # One-token-per-sequence calls on a CPU main device take the native path
        # (``cpu_decode``) when it covers the model; False keeps the layer-by-layer path
        # (what the tests compare with).
        self.native_decode = True
        self._decode_step: DecodeStep | None | bool = False  # False: not built yet
        # Set by ``unload``. A prompt slice of a large model runs for many seconds, and a
        # thread still inside torch when the interpreter tears down aborts the process
        # ("terminate called without an active exception"): closing must not wait that long.
        self._unloading = threading.Event()

    def unload(self) -> None:
        """A call running now ends at its next layer, and later calls fail (ModelUnloadedError)."""
        self._unloading.set()

    def _check_loaded(self) -> None:
        if self._unloading.is_set():
            raise ModelUnloadedError()

    def _layers(self, x: torch.Tensor, segments: list[Segment],
                stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """The decoder layers over rows of one or more sequences; on a model split across
        devices the hidden states move at stage boundaries. `stop`: asked before each layer;
        True ends the call there (Cancelled)."""
        for i, layer in enumerate(self.layers):
            self._check_loaded()
            if stop is not None and stop():
                raise Cancelled("the call was stopped")
            device = self.boundaries.get(i)
            if device is not None:
                x = x.to(device, non_blocking=True)
            x = layer(x, segments)
        return x

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, last_only: bool = False,
                seq: Sequence | None = None, prompt: bool | None = None) -> torch.Tensor:
        """prompt: the tokens are (part of) a prompt, computed as prompt rows even when there
        is one (default: when there are several); else a decode token."""
        batched = tokens.dim() == 2
        if batched and tokens.shape[0] != 1:
            raise ValueError(f"batch size {tokens.shape[0]}: pass one sequence per call, or use forward_batch")
        ids = tokens.reshape(-1)
        seq = self.sequence if seq is None else seq
        decode = ids.shape[0] == 1 if prompt is None else not prompt
        logits = self._run([(seq, ids.tolist(), start_pos)], last_only=last_only, decode=decode)[0]
        return logits.unsqueeze(0) if batched else logits

    def forward_batch(self, calls: list[tuple[Sequence, list[int], int]], *, prompt: bool = False,
                      stop: Callable[[], bool] | None = None) -> list[torch.Tensor]:
        """(sequence, token ids, start_pos) per sequence -> each one's last logits [V]: one
        decode token per sequence, or (prompt) a slice of each one's prompt. Not a torch
        inference-mode function as a whole: the native decode step does not need the mode
        (``_run``). A prompt call asks `stop` before each layer: True ends it there (raises
        Cancelled; the cache holds what it held before the call)."""
        if not prompt and any(len(ids) != 1 for _, ids, _ in calls):
            raise ValueError("a decode step runs one token per sequence")
        return [logits[-1] for logits in self._run(calls, last_only=True, decode=not prompt, stop=stop)]

    def _run(self, calls: list[tuple[Sequence, list[int], int]], *, last_only: bool,
             decode: bool, stop: Callable[[], bool] | None = None) -> list[torch.Tensor]:
        """Prepare every sequence's cache (all checks first: a refused call changes nothing),
        run the layers over all rows, commit. Returns float32 logits per call: [T, V], or
        [1, V] with last_only. `decode`: the rows are decode tokens of different sequences,
        else prompt tokens."""
        self._check_loaded()
        seqs = [seq for seq, _, _ in calls]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        if len(calls) > 1:  # (one sequence: prepare checks before it changes anything)
            for seq, ids, start in calls:
                self.cache.check(seq, start, len(ids))
        segments, row = [], 0
        for seq, ids, start in calls:
            self.cache.prepare(seq, start, len(ids))
            segments.append(Segment(seq, start, len(ids), row))
            row += len(ids)
        flat = [t for _, ids, _ in calls for t in ids]
        step = self._native_decode(len(segments)) if decode else None
        if step is not None:
            # Decode rows by construction, and the mode its PyTorch parts need entered by
            # them: neither context below, each tens of microseconds a token on cold caches.
            logits = step(flat, segments)  # it embeds the tokens itself
            rows = None if len(segments) == 1 else [s.rows for s in segments]  # None: all of them
        else:
            # A row's numbers must not depend on which rows share its call: tokens of a decode
            # step each as alone, a prompt's tokens however the prompt was chunked.
            with native_kernels.rows_are("decode" if decode else "prompt"), torch.inference_mode():
                ids = torch.tensor(flat, dtype=torch.long, device=self.device)
                x = F.embedding(ids, self.embed) if self.embed is not None else self.embed_stored.rows(ids, self.dtype)
                # The residual stream in float32, as llama.cpp's and the native decode step's: in
                # bf16 each layer's sum rounded it again (a first greedy token that llama.cpp and
                # the float32 product share, at a margin of 0.05, went another way); the blocks
                # read it normalised in the compute dtype and their outputs add in float32.
                x = self._layers(x.float(), segments, stop)
                if last_only:
                    x = x[[s.row + s.n - 1 for s in segments]]
                    rows = [slice(i, i + 1) for i in range(len(segments))]
                else:
                    rows = [s.rows for s in segments]
                # Last rows, one per sequence, take the head's few-token path at any count, as a
                # decode step's do (a prompt's many-token path dequantized the whole head for them).
                with native_kernels.rows_are("decode" if last_only or decode else "prompt"):
                    logits = self._logits(self.norm(x))
        outs = [logits] if rows is None else [logits[r] for r in rows]
        for seq, ids, start in calls:
            self.cache.commit(seq, start, ids)
        self.stats.add_tokens(len(flat))
        return outs

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits. A native head's are its kernels' float32 sums, as the decode step's
        are: rounded to bf16 (a step of 1/64 near 3, of 1/8 near 20), near ties in a large
        vocabulary became ties, and greedy picks among them by index."""
        if self.lm_head.runs_native:
            return self.lm_head(h, float32=True)
        return self.lm_head(h).float()

    def decode_machine(self) -> decode_path.Machine:
        """What of this process and the model's placement decides its decode path."""
        native_off = None
        if not native_kernels.enabled():
            native_off = ("the native kernels are turned off by HYBRIDMOE_NATIVE" if native_kernels.available()
                          else f"the native kernels are {native_kernels.isa()}")
        elif not self.native_decode:
            native_off = "the native decode step is turned off for this model"
        split = ("layers in pipeline stages" if self.boundaries else "layers split across cards" if self.cards
                 else "experts streamed by a scheduler" if self.scheduler is not None else None)
        return decode_path.Machine(main_device="cpu" if self.device.type == "cpu" else str(self.device),
                                   native_off=native_off, split=split,
                                   gpu_kernels_off=None if triton_available() else "Triton is not installed")

    def describe(self) -> list[layer_description.Layer]:
        """What each layer's blocks are, as loaded (whole layers on one device only: split
        layers are shards)."""
        return [layer_description.Layer(layer.attn.describe(), layer.ffn.describe(), layer.attn_norm.describe())
                for layer in self.layers]

    def decode_plan(self) -> decode_path.DecodePlan:
        """The path each layer takes for one new token, and why (``decode_path``)."""
        # Layers split across cards are shards, which are not described.
        return decode_path.decode_plan(None if self.cards else self.describe(), self.decode_machine(), len(self.layers))

    def _native_decode(self, rows: int = 1) -> DecodeStep | None:
        """The native one-token path on a CPU main device (``cpu_decode``), built on first use
        with room for a step of every sequence the cache is sized for (or `rows`, if more)."""
        if not self.native_decode or not native_kernels.enabled():
            return None
        if self._decode_step is False or (self._decode_step is not None and self._decode_step.max_rows < rows):
            self._decode_step = DecodeStep.build(self, max(rows, self.max_sequences))
        return self._decode_step

    def set_mla_absorb(self, absorb: bool | None) -> None:
        """Force MLA's absorbed (True) or expanded (False) form, or let it choose (None)."""
        for layer in self.layers:
            for attn in layer.attn.parts if self.cards else (layer.attn,):  # split across cards: each card's
                if attn.latent:
                    attn.absorb = absorb
        self._decode_step = False  # rebuilt for the next decode: the native one is absorbed only


def _default_dtype(embed: Any, gguf_on_cpu: bool) -> torch.dtype:
    """float32 for float32 checkpoints (the tests) and for a GGUF whose every layer runs on the
    CPU, else bfloat16 (float16 activations overflow in DeepSeek-style models).

    A GGUF carries no compute dtype; its reference is llama.cpp, whose CPU backend keeps every
    activation in float32 and its KV cache in float16. In bfloat16 the engine rounded each
    block's output to 8 bits of mantissa, and its greedy tokens left llama.cpp's on BF16 and
    Q8_0 files at margins of 0.006-0.043 of the logits' spread (benchmarks/greedy_vs_llama_cpp.py);
    on the CPU float32 costs little, the kernels computing in float32 either way."""
    if gguf_on_cpu or (isinstance(embed, torch.Tensor) and embed.dtype == torch.float32):
        return torch.float32
    return torch.bfloat16


def _cpu_alone(device: torch.device) -> bool:
    """A CPU device that computes as a CPU (not standing in for a card, as in the tests)."""
    return device.type == "cpu" and not stored_linear_module.serves(device)


def _cache_dtype(dtype: torch.dtype, gguf_on_cpu: bool) -> torch.dtype:
    """The KV cache's elements: float16 for a GGUF computed in float32 on the CPU, as llama.cpp's
    default cache (the same bytes as bfloat16, three more bits of mantissa: a BF16 file's logits
    0.0007 of their spread from the exact product's, against 0.0067 with a bfloat16 cache),
    else the compute dtype."""
    return torch.float16 if gguf_on_cpu and dtype == torch.float32 else dtype


def _embedding_dtype(stored: Any, dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The embedding table's dtype: with a 16-bit cache, 16-bit however the activations are
    computed (the table is the largest widened tensor: 2.3 GB of Kimi K2's in 16 bits):
    bfloat16 where the file stores it so, else float16 (a quantized table's values, 3 bits
    more exact than bfloat16's; ``_embedding`` falls back to bfloat16 where one would overflow).
    With a float32 cache (a float32 checkpoint; the exact product a benchmark asks for), float32."""
    if dtype != torch.float32 or cache_dtype == torch.float32:
        return dtype
    return torch.bfloat16 if getattr(stored, "dtype", None) == torch.bfloat16 else torch.float16


def _table_as_stored(stored: Any, weights: Any, device: torch.device) -> NativeLinear | None:
    """A GGUF's embedding table held as the file stores it on a CPU main device, each lookup
    dequantizing the rows it reads in float32 (``NativeLinear.rows``), where the kernels read
    its type; else None (the table is widened). llama.cpp looks its rows up so: widened to
    float16, a quantized table's rows sat 2e-4 of their size from its, which flipped the first
    layer's Q8 codes (on a trained model's prompt, logits 0.003 of their spread apart); and the
    table is the largest widened tensor (Kimi K2's: 2.3 GB in 16 bits, 0.6 GB in Q4_K)."""
    if (device.type != "cpu" or not native_kernels.enabled() or checkpoint_kind(weights) != "gguf"
            or native_kernels.native_format(stored) is None):
        return None
    try:
        return NativeLinear(stored, interleave=False)
    except Unsupported:
        return None


def _embedding(b: Build, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    table = b.load.tensor("model.embed_tokens.weight", (vocab, b.hidden), dtype=dtype)
    if dtype == torch.float16 and not bool(torch.isfinite(table).all()):
        table = b.load.tensor("model.embed_tokens.weight", (vocab, b.hidden), dtype=torch.bfloat16)
    return table


def _spec(config: Mapping[str, Any], name: str | None) -> ModelSpec:
    """The spec of a config dict, read by its family; a family the registry lacks is one
    the llama.cpp backend may still run."""
    try:
        family_for_config(config, "config.json")
    except UnsupportedModelError as e:
        raise UnsupportedModelError(e.what, "Run this model with `--backend llamacpp`.") from None
    return spec_from_config(config, name or "model")


def default_device() -> str:
    """The main device when none is named: CUDA when present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_model(
    model: ModelSpec | Mapping[str, Any],
    weights: WeightSource,
    placement: Placement | None = None,
    device: torch.device | str | None = None,
    *,
    max_context: int = 4096,
    sequences: int = 1,
    sliding_rewind: int = SLIDING_REWIND_TOKENS,
    dtype: torch.dtype | None = None,
    cache_dtype: torch.dtype | None = None,
    name: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    pipeline: Seq[tuple[torch.device | str, Collection[int]]] | None = None,
    tensor_parallel: Seq[tuple[torch.device | str, Placement]] | None = None,
    resident_form: str = "dense",
    hybrid: HybridOptions | None = None,
) -> MoeTransformer:
    """Build the model a spec (or a config.json) describes from `weights`.

    model: the ModelSpec (``inspect_model(path).spec``), or a Hugging Face config dict (the
        whole config.json, or its text_config), read into one by the model's family.
    placement: {layer index: expert ids on the main device}; missing layers run all their
        routed experts on the CPU.
    device: the main device (default: CUDA when present, else CPU).
    max_context: tokens one conversation may reach.
    sequences: conversations the KV cache holds at that length (the plan's users); its
        blocks are allocated once, here.
    sliding_rewind: positions a sliding-window layer keeps beyond its window, so that a
        conversation can be rewound that far without a new prefill (CacheRewindError beyond).
    dtype: compute dtype (default: float32 for a float32 checkpoint and for a GGUF run on the
        CPU alone, else bfloat16: ``_default_dtype``).
    cache_dtype: the KV cache's elements (default: ``_cache_dtype``).
    on_progress: called with (layers built, total layers).
    pipeline: (device, layers) stages in order, each layer in one of them (the Plan's split
        across GPUs); a layer's attention, cache, dense or shared weights and main-device
        experts live on its stage's device, the embedding on the first, the head on the last.
        Default: every layer on `device`.
    tensor_parallel: (device, placement) of each card, the main one first: every layer split
        across them (``tensor_parallel``), each card holding its placement's experts;
        `placement` and `pipeline` are then not given.
    resident_form: "dense" (compute dtype), "int8", "int4" or "stored" main-device experts, as the Plan chose.
    hybrid: run the MoE layers through ``hybrid.HybridScheduler`` with these options. Default:
        with default options when any layer is on a GPU; never on a CPU-only model (pass
        options to run the scheduler there anyway, as the tests do).
    """
    spec = model if isinstance(model, ModelSpec) else _spec(model, name)
    family = spec.family
    config = spec.config
    weights = text_model_weights(weights)
    device = _device(device if device is not None else default_device())
    # Every layer on the CPU, its experts in host RAM (experts placed on the main device, cards,
    # or a main device holding matrices as a card does stand in for a GPU: the tests build them
    # on the CPU). The planner reads the same (budget.engine_numerics).
    gguf_on_cpu = (checkpoint_kind(weights) == "gguf" and not tensor_parallel and not any((placement or {}).values())
                   and all(_cpu_alone(_device(d)) for d, _ in (pipeline or [(device, ())])))
    embed_weight = require(weights, "model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size))
    if dtype is None:
        dtype = _default_dtype(embed_weight, gguf_on_cpu)
    cards = [(_device(d), _placement(p)) for d, p in tensor_parallel or ()]
    if cards:
        if placement or pipeline:
            raise ValueError("tensor_parallel names each card's experts and devices: pass no placement or pipeline")
        device = cards[0][0]
        placement = {}
        for _, on_card in cards:
            for layer, ids in on_card.items():
                if set(placement.get(layer, ())) & set(ids):
                    raise ValueError(f"tensor_parallel: layer {layer}'s experts {sorted(ids)} are on two cards")
                placement[layer] = tuple(sorted((*placement.get(layer, ()), *ids)))
    placement = _placement(placement)

    n_layers = spec.num_layers
    moe_layers = list(spec.moe_layers)
    stray = sorted(layer for layer, ids in placement.items() if ids and layer not in set(moe_layers))
    if stray:
        raise ValueError(f"placement names layers {stray}, which have no routed experts (MoE layers: {moe_layers})")
    recorder = ExpertRecorder(name or str(config.get("_name_or_path") or family), spec.n_routed_experts,
                              moe_layers, placement)
    stage_of = _stages(pipeline, n_layers, device)
    device = stage_of[0][0]
    b = Build(spec, weights, placement, device, dtype, max_context, recorder, sliding_rewind=sliding_rewind,
              cache_dtype=cache_dtype or _cache_dtype(dtype, gguf_on_cpu))
    b.resident_form = resident_form
    b.sequences = sequences
    vocab = spec.vocab_size
    embed_stored = stored_linear(embed_weight, None, b.device) or _table_as_stored(embed_weight, weights, b.device)
    embed = (None if embed_stored is not None
             else _embedding(b, vocab, _embedding_dtype(embed_weight, dtype, b.cache_dtype)))
    # The build compiles the layers' architecture from their descriptions. What those say of
    # the loaded forms (the checkpoint's kind, formats the native kernels read, where the
    # experts are) it does not read: the built modules state it (``MoeTransformer.describe``).
    described = family_by_name(family).describe_layers(spec, Loading(
        main_device="cpu" if device.type == "cpu" else str(device), context=max_context, checkpoint="safetensors",
        cache_dtype=str(b.cache_dtype).removeprefix("torch."), projections_native=False))
    layers = []
    for i, d in enumerate(described):
        b.on(stage_of[i][0])
        b.norms = d.norm
        if cards:
            attn = _on_cards(b, cards, lambda: build_layers.attention(b, i, d.attention))
            ffn = _on_cards(b, cards, lambda: build_layers.feed_forward(b, i, d.ffn))
        else:
            attn, ffn = build_layers.attention(b, i, d.attention), build_layers.feed_forward(b, i, d.ffn)
        layers.append(DecoderLayer(
            b.norm(f"model.layers.{i}.input_layernorm.weight"), attn,
            b.norm(f"model.layers.{i}.post_attention_layernorm.weight"), ffn,
        ))
        if on_progress is not None:
            on_progress(i + 1, n_layers)
    norm = b.norm("model.norm.weight")
    if "lm_head.weight" not in weights and not spec.tie_word_embeddings:
        raise missing_tensor(weights, "lm_head.weight")
    if cards:  # each card its rows of the head (the embedding's, when tied)
        name = "lm_head" if "lm_head.weight" in weights else "model.embed_tokens"
        heads = []
        for c, (dev, _) in enumerate(cards):
            b.on(dev)
            heads.append(b.load.linear(name, vocab, b.hidden, bias=False, rows=part(vocab, c, len(cards))))
        b.on(device)
        lm_head = HeadShards(heads, [d for d, _ in cards])
    elif "lm_head.weight" in weights:
        lm_head = b.load.linear("lm_head", vocab, b.hidden, bias=False)
    else:
        # The head reads the embedding table: in its stored form on a CPU main device, else
        # the embedding's own (no second copy where both are on one device): its blocks on a
        # GPU that holds it as stored, or its materialised tensor.
        if embed_stored is not None and not embed_stored.runs_native:  # a card's blocks (StoredLinear)
            lm_head = (embed_stored if embed_stored.data.device == b.device
                       else StoredLinear(embed_stored.stored.to(b.device)))
        else:
            lm_head = native_linear(embed_weight, None, b.device, dtype) or Linear(embed.to(b.device, dtype))
    net = MoeTransformer(family=family, spec=spec, config=b.config, embed=embed, embed_stored=embed_stored,
                         layers=layers, norm=norm, lm_head=lm_head, recorder=recorder, placement=placement,
                         device=device, dtype=dtype, max_context=max_context, cache=b.cache, max_sequences=sequences)
    net.boundaries = {i: stage_of[i][0] for i in range(1, n_layers) if stage_of[i][1] != stage_of[i - 1][1]}
    net.cards = [d for d, _ in cards]
    if hybrid is None and any(d.type != "cpu" for d, _ in stage_of):
        hybrid = HybridOptions()
    if hybrid is not None:
        net.scheduler = attach(b.moe_blocks, hybrid)
    if not cards and all(d.type == "cpu" for d, _ in stage_of) and native_kernels.enabled():
        _norms_in_float32(net)
    return net


def _norms_in_float32(net: MoeTransformer) -> None:
    """Norms hand their float32 value, unrounded, to the blocks the native kernels compute on
    a CPU: their projections and experts read float32 rows (quantizing them per row as
    llama.cpp does, or into their GEMM) and round their outputs to the compute dtype; the
    routers read them too (``routing``). With the rows rounded to bf16 first, a prompt's
    logits were further from the exact product of a file's weights than llama.cpp's: on the
    mid-size benchmark model, 0.047 of the logits' spread against llama.cpp's 0.043 in Q3_K,
    0.024 against 0.019 in IQ4_XS; 0.035 and 0.017 with float32 rows
    (benchmarks/greedy_vs_llama_cpp.py --reference). Also on AMX, whose bf16 tiles take bf16
    rows alone (native on_tiles): float32 rows go to the AVX-512 GEMM there, which costs a
    prompt little, the GEMVs serving most formats' prompts (a 512-token prompt of the mid-size
    model's UD-Q2_K_XL mix on a 2-core Sapphire Rapids-class VM: 1.31x llama.cpp's rate in
    bfloat16 on tiles, 1.23x in float32; `hybridmoe bench generate --types`)."""
    for layer in net.layers:
        if _reads_float32(layer.attn.describe()):
            layer.attn_norm.float32 = True
        if _reads_float32(layer.ffn.describe()):
            layer.ffn_norm.float32 = True
    if getattr(net.lm_head, "runs_native", False):
        net.norm.float32 = True


def _reads_float32(block: Any) -> bool:
    """Whether everything of a described block that reads its input takes float32 rows: native
    projections and host experts (the router always does); not PyTorch's resident experts."""
    if isinstance(block, layer_description.MixtureOfExperts):
        shared = block.shared is None or block.shared.projections_native
        gate = not block.shared_gate or block.shared_gate_native
        return (shared and gate and not block.experts_on_main and not block.streamed
                and (not block.experts_on_host or block.experts_native is None))
    return block.projections_native


def _placement(p: Placement | None) -> dict[int, tuple[int, ...]]:
    return {int(k): tuple(sorted(int(e) for e in v)) for k, v in (p or {}).items()}


def _on_cards(b: Build, cards: list[tuple[torch.device, dict]], build: Callable[[], nn.Module]) -> Shards:
    """A block built once per card, each from that card's share (``Build.card``)."""
    home, everything = b.device, b.placement
    parts = []
    for c, (dev, on_card) in enumerate(cards):
        b.card, b.placement = (c, len(cards)), on_card
        b.on(dev)
        parts.append(build())
    b.card, b.placement = None, everything
    b.on(home)
    return Shards(parts, [d for d, _ in cards])


def _stages(pipeline, n_layers: int, device: torch.device) -> list[tuple[torch.device, int]]:
    """(device, stage index) of every layer; one stage on `device` without a pipeline."""
    if not pipeline:
        return [(device, 0)] * n_layers
    found: dict[int, tuple[torch.device, int]] = {}
    for stage, (dev, layers) in enumerate(pipeline):
        for layer in layers:
            if layer in found or not 0 <= layer < n_layers:
                raise ValueError(f"pipeline: layer {layer} is out of range or in two stages")
            found[layer] = (_device(dev), stage)
    missing = sorted(set(range(n_layers)) - set(found))
    if missing:
        raise ValueError(f"pipeline: layers {missing} are in no stage")
    out = [found[i] for i in range(n_layers)]
    if any(out[i][1] < out[i - 1][1] for i in range(1, n_layers)):
        raise ValueError("pipeline: stages must hold consecutive runs of layers, in order")
    return out


def _device(d: torch.device | str) -> torch.device:
    """A CUDA device with its index (what tensors report), other devices as given."""
    d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d
