"""Llama-family forward (llama, mistral, qwen2) over the paged KV cache.

Takes the weights of a loaded transformers model once (fusing q/k/v and gate/up into
single matrices), then runs flat token batches: every scheduled token of every
sequence in one [T, hidden] tensor, no padding, logits only where a token is sampled.
It owns the K/V tensors; it must not decide which blocks a sequence gets (that is
kv_cache.py) nor which tokens run (scheduler.py). The matmul weights come in levels
(wattserve/kernels/quant.py): the loaded one is built at start, others from the transformers
model's weights on first use; forward() reads the active level once per call, so a
switch between two steps leaves the KV cache and every running sequence as they are.
Everything lives on one torch device (the engine's): weights, the KV pool, the rotary
table and each step's tensors, which prepare() builds on the host (the block tables
gathered from rows kept per sequence, block_table.py) and moves in one copy
(from pinned memory, non-blocking, on CUDA). forward() itself never reads a value back to
the host. Attention is one call per layer for every step kind: on the CPU the C++ kernel,
on CUDA our Triton kernel (wattserve/kernels/triton_attention.py; its query tiles come
with the step's inputs), elsewhere or without triton a static-shape decode attention or,
for prefill and mixed steps, paged_attention_torch fed with the chunk bounds the host
already knows.
"""

from __future__ import annotations

import importlib.util
import threading
from array import array
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from wattserve.daemon.engine.block_table import HostBlockTable, TableRows
from wattserve.daemon.engine.families import (
    SUPPORTED_ARCHITECTURES,  # noqa: F401  (re-export)
    FamilyConfigError,
    RawLayer,
    describe,
    inner_model,
    take_layer,
    text_config,
)
from wattserve.daemon.engine.moe import MoeBlock, MoeSpec, moe_block_from_weights, moe_spec
from wattserve.daemon.engine.rope import RopeTable, init_function, partial_rotary_perm
from wattserve.daemon.engine.scheduler import ScheduledChunk
from wattserve.kernels.attention import (
    paged_attention,
    paged_attention_torch,
    paged_decode_attention,
    query_tiles,
    rope_write_kv,
)
from wattserve.kernels.extension import load_cpu_kernels
from wattserve.kernels.linear import Linear
from wattserve.kernels.norm_rope import add_rms_norm, rms_norm, silu_mul
from wattserve.kernels.quant import (
    LinearLike,
    full_precision_level,
    head_level,
    linear_nbytes,
    make_linear,
    parse_level,
)

# Whether kernels/attention.py takes a sliding window (every backend does).
WINDOW_SUPPORTED = True


@dataclass
class DenseMLP:
    """gate|up -> activation(gate) * up -> down. The feed-forward slot of a layer: an
    MoE block (moe.py) takes its place with the same call, nbytes and linears."""

    gate_up: LinearLike  # hidden -> 2 * inter
    down: LinearLike  # inter -> hidden
    activation: str = "silu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.activation == "silu":
            return self.down(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)

    @property
    def linears(self) -> tuple[LinearLike, ...]:
        return (self.gate_up, self.down)


@dataclass
class LayerWeights:
    norms: dict[str, torch.Tensor]  # the family's layer norms by checkpoint name, shared
    q_norm: torch.Tensor | None  # shared between levels; None without q/k norm
    k_norm: torch.Tensor | None
    qkv: LinearLike  # hidden -> (H + 2*KVH) * D, with bias for qwen2
    o: LinearLike  # H * D -> hidden
    mlp: DenseMLP  # or any block with the same call (the MoE one)

    @property
    def linears(self) -> tuple[LinearLike, ...]:
        return (self.qkv, self.o, *self.mlp.linears)


@dataclass(frozen=True)
class LevelWeights:
    """One quantization level's matmul weights; norms are shared between levels."""

    level: str
    layers: list[LayerWeights]
    lm_head: LinearLike
    linear_bytes: int  # every linear incl. the LM head (a separate copy when tied)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int


@dataclass
class StepInputs:
    """One step's tensors: every scheduled chunk's tokens, chunk after chunk."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64 flat cache slot of each token
    block_tables: torch.Tensor  # [B, NB] int64, one row per chunk, padded
    query_start: torch.Tensor  # [B + 1] int64: chunk b's tokens are rows [b] .. [b+1]
    context_lens: torch.Tensor  # [B] int64: chunk b's sequence length after this step
    logits_indices: torch.Tensor  # [N + M] rows of the flat batch that get logits
    sampled_chunks: list[ScheduledChunk]  # the N chunks whose logits those are, in order
    # Then M rows for prompt logprobs: (chunk, rows) for each chunk asked for in prepare().
    prompt_logit_chunks: list[tuple[ScheduledChunk, int]] = field(default_factory=list)
    # The same bounds as host lists, so that attention off the CPU needs no read-back.
    host_query_start: list[int] | None = None
    host_context_lens: list[int] | None = None
    # [tiles, 2] (chunk, first row in it): the Triton attention's work list for a step that
    # is not decode-only (attention.query_tiles); empty otherwise.
    query_tiles: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        """Every chunk is one token (a decode step)."""
        return self.input_ids.shape[0] == self.context_lens.shape[0]


@dataclass
class StepLayout:
    """One step's inputs as host lists (the fields of StepInputs, same meaning)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # rows of equal width
    # The same rows as one [B, W] host tensor when layout() made them (block_tables then
    # reads it as lists only when asked); inputs_from() copies the tensor as it is.
    block_table: torch.Tensor | None = None
    sampled_chunks: list[ScheduledChunk] = field(default_factory=list)
    prompt_logit_chunks: list[tuple[ScheduledChunk, int]] = field(default_factory=list)
    query_tiles: list[int] = field(default_factory=list)  # flat (chunk, first row) pairs

    def parts(self) -> tuple[list[int], ...]:
        """The int64 fields in the order of one flat device buffer."""
        table = [b for row in self.block_tables for b in row]
        return (
            self.input_ids,
            self.positions,
            self.slots,
            self.query_start,
            self.context_lens,
            self.logits_indices,
            table,
            self.query_tiles,
        )


def model_shape(hf_config) -> ModelShape:
    cfg = text_config(hf_config)
    heads = cfg.num_attention_heads
    max_positions = cfg.max_position_embeddings
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "dynamic":
        # Dynamic NTK stretches the base past max_position_embeddings by up to `factor`.
        max_positions = int(max_positions * float(rope.get("factor", 1.0)))
    return ModelShape(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or cfg.layer_norm_eps,
        max_position_embeddings=max_positions,
    )


class LlamaModel:
    """The forward pass and its KV tensors; weights taken from a transformers model.

    Every family (families.py) runs through this one forward; its Family says where the
    norms sit, which multipliers and soft-caps apply and which rope table a layer reads.
    """

    def __init__(
        self,
        hf_model,
        num_blocks: int | None,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """num_blocks None: no KV pool yet (allocate_kv_cache() once the weights sit on
        the device and its free memory is known). Raises FamilyConfigError for a config
        the engine cannot run."""
        cfg = text_config(hf_model.config)
        self.family = fam = describe(hf_model.config, window_supported=WINDOW_SUPPORTED)
        self.shape = s = model_shape(hf_model.config)
        self.dtype = dtype
        self.device = dev = torch.device(device)
        # Off the CPU, uploads go through these (the engine's DeviceOps; set_device_ops).
        self._device_ops = None
        self._staging = None
        self.block_size = block_size
        self.scale = fam.attn_scale if fam.attn_scale is not None else s.head_dim**-0.5
        inner = inner_model(hf_model)
        self._hf_model = hf_model  # the full-precision source of every other level
        self.full_precision_level = full_precision_level(dtype)
        self._levels: dict[str, LevelWeights] = {}
        self._prepare_lock = threading.Lock()
        self.ropes = {
            lt: RopeTable(
                cfg,
                lt,
                init_function(inner.rotary_emb, cfg, lt),
                s.head_dim,
                s.max_position_embeddings,
                dtype,
                dev,
            )
            for lt in fam.rope_types
        }
        self.rope = next(iter(self.ropes.values()))
        if len(self.ropes) > 1 and any(r.length_dependent for r in self.ropes.values()):
            raise FamilyConfigError(
                "rope_parameters: a length-dependent rope type on one of several layer types"
            )
        self._perm = partial_rotary_perm(s.head_dim, self.rope.rotary_dim)
        # Gemma's (1 + w) norms run in float32; others in the model's dtype.
        self._norm_dtype = torch.float32 if fam.norm_one_plus else dtype
        with torch.no_grad():
            embed = inner.embed_tokens.weight.detach()
            self.embed = embed.to(dev, dtype).contiguous()
            # Gemma rounds sqrt(hidden) to the model's dtype before scaling.
            self.embed_scale = torch.tensor(fam.embed_scale, dtype=dtype, device="cpu").item()
            head_param = hf_model.get_output_embeddings().weight
            same = head_param.data_ptr() == embed.data_ptr()
            self.tied_embeddings = same
            head = Linear(self.embed if same else head_param.detach().to(dev, dtype))
            self.final_norm = self._norm_weight(inner.norm.weight)
            # None for a dense layer; a MoE block (moe.py) takes the MLP's slot otherwise.
            self.moe_specs = [moe_spec(cfg, i) for i in range(len(inner.layers))]
            raws = [take_layer(layer, fam) for layer in inner.layers]
            layers = [
                self._layer(raw, self._full_precision_linear, None, spec)
                for raw, spec in zip(raws, self.moe_specs, strict=True)
            ]
        base = LevelWeights(self.full_precision_level, layers, head, _linear_bytes(layers, head))
        self._levels[base.level] = base
        self._active = base
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.num_blocks = 0
        self.pad_block = 0
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)
        # Built (first start on this machine) or loaded now, not in the first request's step.
        self.attention_backend = _attention_backend(dev)
        # Each sequence's block ids as a host tensor row, written as its table grows.
        self.host_block_table = HostBlockTable()
        # Per-layer sliding windows (None: full causal) and the logit soft-cap, for the
        # model families that have them; every attention backend takes both.
        self.sliding_windows: list[int | None] = list(fam.windows)
        self.logit_softcap: float | None = fam.attn_softcap

    def prefix_salt(self, seq) -> bytes:
        """What a sequence's cached KV depends on besides its tokens (KVCacheManager.match)."""
        return self.rope.prefix_salt(len(seq.prompt_token_ids), seq.num_tokens)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The paged K/V pool: num_blocks blocks for the KV manager plus one more, block
        `pad_block`, that it never hands out: padded rows of a bucketed decode batch
        write their K/V there."""
        s = self.shape
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        cache_shape = (num_blocks + 1, self.block_size, s.num_kv_heads, s.head_dim)

        def pool() -> list[torch.Tensor]:
            return [
                torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
                for _ in range(s.num_layers)
            ]

        self.k_cache, self.v_cache = pool(), pool()

    def _full_precision_linear(self, w: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        b = None if bias is None else bias.to(self.device, self.dtype)
        return Linear(w.to(self.device, self.dtype), b)

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A norm's weight as forward() uses it: (1 + w) in float32 for Gemma."""
        if self.family.norm_one_plus:
            return (1.0 + w.detach().float()).to(self.device)
        return w.detach().to(self.device, self.dtype)

    def _head_norm_weight(self, w: torch.Tensor | None, heads: int) -> torch.Tensor | None:
        """A q/k norm's weight, its head dims in the order the q/k rows were permuted to."""
        if w is None:
            return None
        if self._perm is not None:
            d = self.shape.head_dim
            w = w.view(-1, d).index_select(1, self._perm).reshape(w.shape)
        return self._norm_weight(w)

    def _permute_qk_rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """q and k rows of a fused qkv weight or bias, each head's dims in rope order."""
        if t is None or self._perm is None:
            return t
        s = self.shape
        d = s.head_dim
        qk_heads = s.num_heads + s.num_kv_heads
        qk, v = t.split([qk_heads * d, s.num_kv_heads * d])
        qk = qk.reshape(qk_heads, d, *t.shape[1:]).index_select(1, self._perm)
        return torch.cat([qk.reshape(qk_heads * d, *t.shape[1:]), v])

    def _layer(
        self, raw: RawLayer, make, shared: LayerWeights | None, moe: MoeSpec | None
    ) -> LayerWeights:
        """One layer's weights; make(weight, bias) builds a linear at the level wanted.
        shared: a prepared level's layer whose norms this one reuses. moe: the layer's
        MoE spec (its router stays at full precision), None for a dense MLP."""
        s = self.shape
        bias = self._permute_qk_rows(raw.qkv_bias)
        if shared is None:
            norms = {name: self._norm_weight(w) for name, w in raw.norms.items()}
            q_norm = self._head_norm_weight(raw.q_norm, s.num_heads)
            k_norm = self._head_norm_weight(raw.k_norm, s.num_kv_heads)
        else:
            norms, q_norm, k_norm = shared.norms, shared.q_norm, shared.k_norm
        return LayerWeights(
            norms=norms,
            q_norm=q_norm,
            k_norm=k_norm,
            qkv=make(self._permute_qk_rows(raw.qkv), None if bias is None else bias),
            o=make(raw.o, None),
            mlp=self._mlp(raw, make, moe),
        )

    def _mlp(self, raw: RawLayer, make, moe: MoeSpec | None) -> DenseMLP | MoeBlock:
        if (moe is None) != (raw.moe is None):
            raise FamilyConfigError(
                "num_experts: the config and the checkpoint's layers disagree on which "
                "layers are mixture-of-experts"
            )
        if moe is None:
            return DenseMLP(make(raw.gate_up, None), make(raw.down, None), self.family.activation)
        full = make is self._full_precision_linear
        return moe_block_from_weights(
            moe,
            *raw.moe,
            None if full else make,
            self._full_precision_linear,
            self.dtype,
            self.device,
        )

    @property
    def graph_capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: not with a MoE layer,
        whose block reads its per-expert token counts back to the host."""
        return all(spec is None for spec in self.moe_specs)

    # ---- quantization levels ---------------------------------------------------------
    @property
    def level(self) -> str:
        """The level forward() uses."""
        return self._active.level

    @property
    def layers(self) -> list[LayerWeights]:
        return self._active.layers

    @property
    def lm_head(self) -> LinearLike:
        return self._active.lm_head

    def is_prepared(self, level: str) -> bool:
        return level in self._levels

    def prepare_level(self, level: str) -> LevelWeights:
        """Build (once) and cache the weights of `level` from the full-precision ones.

        Thread-safe; may take seconds on a real model. Raises QuantLevelError for an
        unknown name. Nothing else changes: forward() keeps its level until use_level().
        """
        spec = parse_level(level)
        with self._prepare_lock:
            if level in self._levels:
                return self._levels[level]
            hf, dtype, dev = self._hf_model, self.dtype, self.device
            base_layers = self._levels[self.full_precision_level].layers

            def make(w: torch.Tensor, bias: torch.Tensor | None) -> LinearLike:
                # Quantized on the device: the CUDA int4 packing is CUDA's own layout.
                return make_linear(w.to(dev), None if bias is None else bias.to(dev), spec, dtype)

            with torch.no_grad():
                layers = [
                    self._layer(take_layer(layer, self.family), make, base, moe)
                    for base, layer, moe in zip(
                        base_layers, inner_model(hf).layers, self.moe_specs, strict=True
                    )
                ]
                head_w = hf.get_output_embeddings().weight.to(dev)
                head = make_linear(head_w, None, head_level(spec, dev), dtype)
            weights = LevelWeights(level, layers, head, _linear_bytes(layers, head))
            self._levels[level] = weights  # one dict store: visible whole or not at all
            return weights

    def use_level(self, level: str) -> None:
        """Make forward() use `level` from its next call (preparing it first if needed).
        Call between steps, on the thread that runs forward()."""
        self._active = self.prepare_level(level)

    def level_bytes(self, level: str) -> int:
        """Bytes of every linear at `level`: measured once prepared, computed before."""
        if level in self._levels:
            return self._levels[level].linear_bytes
        spec = parse_level(level)
        s, dev = self.shape, self.device
        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        attention = linear_nbytes(qkv_out, s.hidden_size, spec, dev) + linear_nbytes(
            s.hidden_size, s.num_heads * s.head_dim, spec, dev
        )
        dense_mlp = linear_nbytes(
            2 * s.intermediate_size, s.hidden_size, spec, dev
        ) + linear_nbytes(s.hidden_size, s.intermediate_size, spec, dev)
        # A MoE layer's router stays at the full-precision dtype (moe.py).
        mlps = sum(
            dense_mlp
            if moe is None
            else moe.linear_bytes(s.hidden_size, spec, dev)
            + moe.num_experts * s.hidden_size * self.dtype.itemsize
            for moe in self.moe_specs
        )
        head = linear_nbytes(s.vocab_size, s.hidden_size, head_level(spec, dev), dev)
        return s.num_layers * attention + mlps + head

    def weight_bytes(self) -> int:
        """Weight bytes one step reads at the active level: the linears incl. the LM head,
        the final norm, and the embedding table when it is not the LM head's own."""
        active = self._active
        total = self.final_norm.numel() * 4 + active.linear_bytes
        if not self.tied_embeddings:
            total += self.embed.numel() * self.embed.element_size()
        return total

    def step_weight_bytes(self, all_weights: int) -> int:
        """Weight bytes the last forward read, from weight_bytes()'s `all_weights`: a MoE
        layer's experts count only where tokens were routed to them (top-k of many)."""
        blocks = [lw.mlp for lw in self._active.layers if isinstance(lw.mlp, MoeBlock)]
        unread = sum((b.spec.num_experts - b.experts_run) * b.expert_nbytes for b in blocks)
        return all_weights - unread

    def prepare(
        self,
        chunks: list[ScheduledChunk],
        tables: dict[str, list[int]],
        prompt_logits: frozenset[str] = frozenset(),
    ) -> StepInputs:
        """Lay out a plan's chunks as flat tensors; block ids come from the KV manager."""
        return self.inputs_from(self.layout(chunks, tables, prompt_logits))

    def layout(
        self,
        chunks: list[ScheduledChunk],
        tables: dict[str, list[int]],
        prompt_logits: frozenset[str] = frozenset(),
    ) -> StepLayout:
        """A plan's chunks as host lists, chunk after chunk (what prepare() moves over).
        Sequences in `prompt_logits` also get logits for each prompt position whose next
        token is a prompt token (after the sampled rows)."""
        bs = self.block_size
        lay = StepLayout()
        ids, pos, slots = lay.input_ids, lay.positions, lay.slots
        extra_rows: list[int] = []
        plain_rows = not self.rope.length_dependent  # a position is its rope table row
        seq_ids: list[str] = []
        seq_tables: list[list[int]] = []
        blocks: list[int] = []
        for c in chunks:
            table = tables[c.seq.seq_id]
            end = c.start + c.num_tokens
            if c.num_tokens == 1 and plain_rows:  # a decode: the common case, kept short
                p, prompt, out = c.start, c.seq.prompt_token_ids, c.seq.output_token_ids
                ids.append(prompt[p] if p < len(prompt) else out[p - len(prompt)])
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            else:
                ids.extend(c.seq.token_ids(c.start, end))
                pos.extend(
                    self.rope.rows(c.start, end, len(c.seq.prompt_token_ids), c.seq.num_tokens)
                )
                slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            lay.query_start.append(len(ids))
            lay.context_lens.append(end)
            seq_ids.append(c.seq.seq_id)
            seq_tables.append(table)
            blocks.append(-(-end // bs))
            if c.samples:
                lay.logits_indices.append(len(ids) - 1)
                lay.sampled_chunks.append(c)
            if c.seq.seq_id in prompt_logits:
                rows_n = max(0, min(end, len(c.seq.prompt_token_ids) - 1) - c.start)
                first = len(ids) - c.num_tokens
                extra_rows.extend(range(first, first + rows_n))
                lay.prompt_logit_chunks.append((c, rows_n))
        lay.logits_indices.extend(extra_rows)
        lay.block_table = self.host_block_table.gather(seq_ids, seq_tables, blocks)
        lay.block_tables = TableRows(lay.block_table)  # type: ignore[assignment]
        if self.attention_backend == "triton" and len(ids) != len(lay.context_lens):
            lay.query_tiles = query_tiles(lay.query_start)
        return lay

    def inputs_from(self, lay: StepLayout, into: torch.Tensor | None = None) -> StepInputs:
        """StepInputs over one int64 device tensor holding `lay`, moved in one copy.

        into: a device buffer of exactly lay's size to copy into (a CUDA graph's static
        inputs) instead of a new tensor.
        """
        if lay.block_table is None:
            parts = lay.parts()
            flat = self.to_device([v for part in parts for v in part], into)
            sizes = [len(part) for part in parts]
        else:  # the lists as one array, the table as it is: no per-block Python work
            lists = [lay.input_ids, lay.positions, lay.slots, lay.query_start]
            lists += [lay.context_lens, lay.logits_indices]
            host = array("q")
            for part in lists:
                host.fromlist(part)
            table = lay.block_table.view(-1)
            tiles = torch.tensor(lay.query_tiles, dtype=torch.long, device="cpu")
            # Under a FakeTensorMode (the device-trace tests) host tensors are fake too.
            head = (
                _long_tensor(host)
                if type(table) is torch.Tensor
                else torch.tensor(host, device="cpu")
            )
            flat = self.to_device(torch.cat([head, table, tiles]), into)
            sizes = [len(part) for part in lists] + [table.numel(), tiles.numel()]
        views = flat.split(sizes)
        rows = len(lay.block_tables)
        return StepInputs(
            input_ids=views[0],
            positions=views[1],
            slots=views[2],
            block_tables=views[6].view(rows, sizes[6] // rows if rows else 0),
            query_start=views[3],
            context_lens=views[4],
            logits_indices=views[5],
            query_tiles=views[7].view(-1, 2),
            sampled_chunks=lay.sampled_chunks,
            host_query_start=lay.query_start,
            host_context_lens=lay.context_lens,
            prompt_logit_chunks=lay.prompt_logit_chunks,
        )

    def to_device(
        self, values: list[int] | torch.Tensor, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int64 [len(values)] on the model's device in one host-to-device copy: through
        pinned memory and non-blocking on CUDA (the copy is ordered on the stream before
        the step's kernels), built in place on the CPU. into: copy into this buffer."""
        if isinstance(values, torch.Tensor):
            host = values  # an int64 host tensor of the caller's, not kept
            if self.device.type == "cpu" and into is None:
                return host
        elif self.device.type == "cpu" and into is None:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        else:
            host = torch.tensor(values, dtype=torch.long, device="cpu")
        if self.device.type == "cpu":  # into a buffer on the CPU: a plain copy
            return into.copy_(host)  # type: ignore[union-attr]
        if self._device_ops is None:
            from wattserve.daemon.engine.device_ops import DeviceOps

            self.set_device_ops(DeviceOps(self.device), persistent=False)
        # a pinned buffer, one non-blocking upload ordered before the step's kernels
        n = len(values)
        ring = self._staging
        staging = ring.take(n) if ring is not None else self._device_ops.pinned(n, torch.long)
        return self._device_ops.upload(staging.copy_(host), into)

    def set_device_ops(self, ops, persistent: bool = True) -> None:
        """Route to_device's uploads through `ops` (device_ops.DeviceOps). persistent:
        from a ring of pinned buffers, which is safe only for a caller that waits on each
        step's read-back before launching the step two after it (the engine); else a new
        pinned buffer per upload."""
        from wattserve.daemon.engine.device_ops import Ring

        self._device_ops = ops
        self._staging = Ring(ops.pinned, torch.long) if persistent else None

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Returns float32 logits [N, vocab] for inp.logits_indices."""
        s, fam = self.shape, self.family
        h_dim = s.num_heads * s.head_dim
        t = inp.input_ids.shape[0]
        active = self._active  # read once: a level switch lands between two calls
        rope = {lt: table.lookup(inp.positions) for lt, table in self.ropes.items()}
        hidden = F.embedding(inp.input_ids, self.embed)  # [T, hidden], the residual stream
        if self.embed_scale != 1.0:
            hidden.mul_(self.embed_scale)
        layers = active.layers
        pre = fam.placement == "pre"
        res = fam.residual_scale
        x = (
            hidden
            if fam.placement == "post"
            else self._norm(hidden, layers[0].norms["input_layernorm"])
        )
        for i, lw in enumerate(layers):
            qkv = lw.qkv(x)  # [T, (H + 2 KVH) D]
            if fam.qk_norm is not None:
                self._qk_norm(qkv, lw)
            cos, sin = rope[fam.layer_rope[i]]
            q = rope_write_kv(
                qkv,
                cos,
                sin,
                self.k_cache[i],
                self.v_cache[i],
                inp.slots,
                s.num_heads,
                s.num_kv_heads,
            )  # [T, H, D], k and v stored
            attn = self._attention(i, q, inp)  # [T, H, D]
            out = lw.o(attn.reshape(t, h_dim))
            if pre:  # the residual add fused with the MLP's norm
                x = add_rms_norm(
                    hidden,
                    out.mul_(res) if res != 1.0 else out,
                    lw.norms["post_attention_layernorm"],
                    s.rms_norm_eps,
                )
            else:
                hidden.add_(self._norm(out, lw.norms["post_attention_layernorm"]))
                x = (
                    hidden
                    if fam.placement == "post"
                    else self._norm(hidden, lw.norms["pre_feedforward_layernorm"])
                )
            out = lw.mlp(x)
            last_layer = i + 1 == len(layers)
            if pre:
                if res != 1.0:
                    out.mul_(res)
                if not last_layer:  # the residual add fused with the next layer's norm
                    x = add_rms_norm(
                        hidden, out, layers[i + 1].norms["input_layernorm"], s.rms_norm_eps
                    )
                else:
                    hidden.add_(out)
            else:
                hidden.add_(self._norm(out, lw.norms["post_feedforward_layernorm"]))
                x = hidden
                if fam.placement == "sandwich" and not last_layer:
                    x = self._norm(hidden, layers[i + 1].norms["input_layernorm"])
        last = self._norm(hidden.index_select(0, inp.logits_indices), self.final_norm)
        logits = active.lm_head(last).float()
        if fam.logits_scale != 1.0:
            logits.mul_(fam.logits_scale)
        if fam.final_softcap is not None:
            logits = torch.tanh(logits / fam.final_softcap) * fam.final_softcap
        return logits

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim: Gemma's in float32 (weight already 1 + w)."""
        if self.family.norm_one_plus:
            out = F.rms_norm(x.float(), (x.shape[-1],), weight, self.shape.rms_norm_eps)
            return out.to(x.dtype)
        if x.dim() == 2 and x.is_contiguous():
            return rms_norm(x, weight, self.shape.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.shape.rms_norm_eps)

    def _qk_norm(self, qkv: torch.Tensor, lw: LayerWeights) -> None:
        """RMSNorm q and k in place in the fused projection, before rope: over each head
        (Qwen3, Gemma 3) or over the whole q and k projections (OLMo 2)."""
        s = self.shape
        t, d = qkv.shape[0], s.head_dim
        for start, heads, weight in (
            (0, s.num_heads, lw.q_norm),
            (s.num_heads * d, s.num_kv_heads, lw.k_norm),
        ):
            part = qkv.narrow(1, start, heads * d)
            view = part.view(t, heads, d) if self.family.qk_norm == "head" else part
            part.copy_(self._norm(view, weight).reshape(t, heads * d))

    def _attention(self, layer: int, q: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """One attention call for the layer, whatever the step's kind (see the backends in
        the module docstring)."""
        caches = (self.k_cache[layer], self.v_cache[layer])
        opts = dict(sliding_window=self.sliding_windows[layer], logit_softcap=self.logit_softcap)
        if self.attention_backend == "triton":
            # imported by _attention_backend at start; this is a lookup in sys.modules
            from wattserve.kernels.triton_attention import triton_paged_attention

            return triton_paged_attention(
                q,
                *caches,
                inp.block_tables,
                inp.query_start,
                inp.context_lens,
                inp.query_tiles,
                self.scale,
                **opts,
            )
        if self.attention_backend == "cpp":
            return paged_attention(
                q.contiguous(),  # already, from the CPU's rope_write_kv
                *caches,
                inp.block_tables,
                inp.query_start,
                inp.context_lens,
                self.scale,
                **opts,
            )
        if inp.decode_only:  # static shapes: no read-back, capturable in a CUDA graph
            return paged_decode_attention(
                q, *caches, inp.block_tables, inp.context_lens, self.scale, **opts
            )
        return paged_attention_torch(
            q,
            *caches,
            inp.block_tables,
            inp.query_start,
            inp.context_lens,
            self.scale,
            host_query_start=inp.host_query_start,
            host_context_lens=inp.host_context_lens,
            **opts,
        )


def _attention_backend(device: torch.device) -> str:
    """cpp: the C++ kernel on the CPU (where it builds); triton: our Triton kernel on CUDA
    (where triton is installed, as with torch's CUDA wheels); torch: SDPA paths otherwise."""
    if device.type == "cpu":
        return "cpp" if load_cpu_kernels() else "torch"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        import wattserve.kernels.triton_attention  # noqa: F401  (compiles nothing yet)
        import wattserve.kernels.triton_rows  # noqa: F401  (the row ops, norm_rope's choice)

        return "triton"
    return "torch"


def _linear_bytes(layers: list[LayerWeights], lm_head: LinearLike) -> int:
    per_layer = sum(lin.nbytes for lw in layers for lin in lw.linears)
    return per_layer + lm_head.nbytes


def _long_tensor(values: array) -> torch.Tensor:
    """An int64 CPU tensor over an array('q') (sharing its memory)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device="cpu")
    return torch.frombuffer(values, dtype=torch.long)
