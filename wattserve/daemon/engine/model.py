"""Llama-family forward (llama, mistral, qwen2, mixtral) over the paged KV cache.

Takes the weights of a loaded transformers model once (fusing q/k/v and gate/up into
single matrices), then runs flat token batches: every scheduled token of every
sequence in one [T, hidden] tensor, no padding, logits only where a token is sampled.
It owns the K/V tensors; it must not decide which blocks a sequence gets (that is
kv_cache.py) nor which tokens run (scheduler.py). The matmul weights come in levels
(wattserve/kernels/quant.py): the loaded one is built at start, others from the transformers
model's weights on first use; forward() reads the active level once per call, so a
switch between two steps leaves the KV cache and every running sequence as they are.
Everything lives on one torch device (the engine's): weights, the KV pool, the rotary
table and each step's tensors, which prepare() builds on the host and moves in one copy
(from pinned memory, non-blocking, on CUDA). forward() itself never reads a value back to
the host: on the CPU it calls the C++ attention kernel, on other devices a static-shape
decode attention or, for prefill and mixed steps, paged_attention_torch fed with the
chunk bounds the host already knows. A mixture-of-experts layer (moe.py) takes the
place of the gate_up/down MLP; everything else about the layer is the same.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from wattserve.daemon.engine.moe import MoeBlock, MoeSpec, build_moe_block, moe_spec
from wattserve.daemon.engine.scheduler import ScheduledChunk
from wattserve.kernels.attention import (
    paged_attention,
    paged_attention_torch,
    paged_decode_attention,
    rope_write_kv,
)
from wattserve.kernels.extension import load_cpu_kernels
from wattserve.kernels.linear import Linear
from wattserve.kernels.norm_rope import RotaryTable, add_rms_norm, rms_norm, silu_mul
from wattserve.kernels.quant import (
    LinearLike,
    QuantLevel,
    full_precision_level,
    head_level,
    linear_nbytes,
    make_linear,
    parse_level,
)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearLike  # hidden -> (H + 2*KVH) * D, with bias for qwen2
    o: LinearLike  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearLike | None  # hidden -> 2 * inter; None in a MoE layer
    down: LinearLike | None  # inter -> hidden; None in a MoE layer
    moe: MoeBlock | None = None  # the sparse MLP that replaces gate_up/down

    def linears(self) -> list[LinearLike | MoeBlock]:
        mlp = [self.moe] if self.moe is not None else [self.gate_up, self.down]
        return [self.qkv, self.o, *mlp]


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
    sampled_chunks: list[ScheduledChunk] = field(default_factory=list)
    prompt_logit_chunks: list[tuple[ScheduledChunk, int]] = field(default_factory=list)

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
        )


def model_shape(hf_config) -> ModelShape:
    heads = hf_config.num_attention_heads
    return ModelShape(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings,
    )


class LlamaModel:
    """The forward pass and its KV tensors; weights taken from a transformers model."""

    def __init__(
        self,
        hf_model,
        num_blocks: int | None,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """num_blocks None: no KV pool yet (allocate_kv_cache() once the weights sit on
        the device and its free memory is known)."""
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {cfg.model_type!r}")
        self.shape = s = model_shape(cfg)
        self.dtype = dtype
        self.device = dev = torch.device(device)
        self.block_size = block_size
        self.scale = s.head_dim**-0.5
        inner = hf_model.model
        self._hf_model = hf_model  # the full-precision source of every other level
        self.full_precision_level = full_precision_level(dtype)
        self._levels: dict[str, LevelWeights] = {}
        self._prepare_lock = threading.Lock()
        with torch.no_grad():
            self.embed = inner.embed_tokens.weight.detach().to(dev, dtype).contiguous()
            head_param = hf_model.get_output_embeddings().weight
            same = head_param.data_ptr() == inner.embed_tokens.weight.data_ptr()
            lm_head = head_param.detach()
            self.tied_embeddings = same
            head = Linear(self.embed if same else lm_head.to(dev, dtype))
            self.final_norm = inner.norm.weight.detach().to(dev, dtype)
            self.moe_specs = [moe_spec(cfg, i) for i in range(len(inner.layers))]
            layers = [
                self._take_layer(layer, spec, None, dtype, dev, None)
                for layer, spec in zip(inner.layers, self.moe_specs, strict=True)
            ]
        base = LevelWeights(self.full_precision_level, layers, head, _linear_bytes(layers, head))
        self._levels[base.level] = base
        self._active = base
        rot = inner.rotary_emb
        self.rope = RotaryTable(
            rot.inv_freq.to(dev),
            s.max_position_embeddings,
            float(rot.attention_scaling),
            dtype,
            device=dev,
        )
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.num_blocks = 0
        self.pad_block = 0
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)
        # Built (first start on this machine) or loaded now, not in the first request's step.
        on_cpu = dev.type == "cpu"
        self.attention_backend = "cpp" if on_cpu and load_cpu_kernels() else "torch"

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

    @staticmethod
    def _take_layer(
        layer,
        spec: MoeSpec | None,
        level: QuantLevel | None,
        dtype: torch.dtype,
        dev: torch.device,
        base: LayerWeights | None,
    ) -> LayerWeights:
        """One layer's weights: level None builds the full-precision packed linears (and
        the norms); otherwise make_linear at `level`, norms shared with `base`."""
        att, mlp = layer.self_attn, layer.mlp

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearLike:
            if level is None:
                return Linear(weight.detach().to(dev, dtype), bias)
            # Quantized on the device: the CUDA int4 packing is CUDA's own layout.
            return make_linear(weight.to(dev), bias, level, dtype)

        qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], dim=0)
        bias = _qkv_bias(att)
        if bias is not None:
            bias = bias.to(dev) if level is not None else bias.to(dev, dtype)
        gate_up = down = moe = None
        if spec is None:
            gate_up = linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0))
            down = linear(mlp.down_proj.weight)
        else:
            moe = build_moe_block(spec, mlp, level, dtype, dev)
        if base is None:
            input_norm = layer.input_layernorm.weight.detach().to(dev, dtype)
            post_norm = layer.post_attention_layernorm.weight.detach().to(dev, dtype)
        else:
            input_norm, post_norm = base.input_norm, base.post_norm
        return LayerWeights(
            input_norm=input_norm,
            qkv=linear(qkv, bias),
            o=linear(att.o_proj.weight),
            post_norm=post_norm,
            gate_up=gate_up,
            down=down,
            moe=moe,
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
            with torch.no_grad():
                base_layers = self._levels[self.full_precision_level].layers
                layers = [
                    self._take_layer(layer, moe, spec, dtype, dev, base_lw)
                    for layer, moe, base_lw in zip(
                        hf.model.layers, self.moe_specs, base_layers, strict=True
                    )
                ]
                head_w = hf.get_output_embeddings().weight.to(dev)
                head = make_linear(head_w, None, head_level(spec), dtype)
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
        s = self.shape
        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        attention = linear_nbytes(qkv_out, s.hidden_size, spec) + linear_nbytes(
            s.hidden_size, s.num_heads * s.head_dim, spec
        )
        dense_mlp = linear_nbytes(2 * s.intermediate_size, s.hidden_size, spec) + linear_nbytes(
            s.hidden_size, s.intermediate_size, spec
        )
        # A MoE layer's router stays at the full-precision dtype (moe.py).
        mlps = sum(
            dense_mlp
            if moe is None
            else moe.linear_bytes(s.hidden_size, spec)
            + moe.num_experts * s.hidden_size * self.dtype.itemsize
            for moe in self.moe_specs
        )
        head = linear_nbytes(s.vocab_size, s.hidden_size, head_level(spec))
        return s.num_layers * attention + mlps + head

    def weight_bytes(self) -> int:
        """Weight bytes one step reads at the active level: the linears incl. the LM head,
        the final norm, and the embedding table when it is not the LM head's own."""
        active = self._active
        total = self.final_norm.numel() * 4 + active.linear_bytes
        if not self.tied_embeddings:
            total += self.embed.numel() * self.embed.element_size()
        return total

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
        for c in chunks:
            table = tables[c.seq.seq_id]
            end = c.start + c.num_tokens
            ids.extend(c.seq.token_ids(c.start, end))
            positions = range(c.start, end)
            pos.extend(positions)
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            lay.query_start.append(len(ids))
            lay.context_lens.append(end)
            lay.block_tables.append(table[: -(-end // bs)])
            if c.samples:
                lay.logits_indices.append(len(ids) - 1)
                lay.sampled_chunks.append(c)
            if c.seq.seq_id in prompt_logits:
                rows_n = max(0, min(end, len(c.seq.prompt_token_ids) - 1) - c.start)
                first = len(ids) - c.num_tokens
                extra_rows.extend(range(first, first + rows_n))
                lay.prompt_logit_chunks.append((c, rows_n))
        lay.logits_indices.extend(extra_rows)
        width = max((len(r) for r in lay.block_tables), default=0)
        lay.block_tables = [_pad(r, width) for r in lay.block_tables]
        return lay

    def inputs_from(self, lay: StepLayout, into: torch.Tensor | None = None) -> StepInputs:
        """StepInputs over one int64 device tensor holding `lay`, moved in one copy.

        into: a device buffer of exactly lay's size to copy into (a CUDA graph's static
        inputs) instead of a new tensor.
        """
        parts = lay.parts()
        flat = self.to_device([v for part in parts for v in part], into)
        views = flat.split([len(part) for part in parts])
        rows = len(lay.block_tables)
        return StepInputs(
            input_ids=views[0],
            positions=views[1],
            slots=views[2],
            block_tables=views[6].view(rows, len(parts[6]) // rows if rows else 0),
            query_start=views[3],
            context_lens=views[4],
            logits_indices=views[5],
            sampled_chunks=lay.sampled_chunks,
            host_query_start=lay.query_start,
            host_context_lens=lay.context_lens,
            prompt_logit_chunks=lay.prompt_logit_chunks,
        )

    def to_device(self, values: list[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [len(values)] on the model's device in one host-to-device copy: through
        pinned memory and non-blocking on CUDA (the copy is ordered on the stream before
        the step's kernels), built in place on the CPU. into: copy into this buffer."""
        if self.device.type == "cpu" and into is None:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        host = torch.tensor(values, dtype=torch.long, device="cpu")
        if self.device.type != "cpu":
            staging = torch.empty(len(values), dtype=torch.long, device="cpu", pin_memory=True)
            host = staging.copy_(host)
        if into is not None:
            return into.copy_(host, non_blocking=True)
        return host.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Returns float32 logits [N, vocab] for inp.logits_indices."""
        s = self.shape
        h_dim = s.num_heads * s.head_dim
        t = inp.input_ids.shape[0]
        active = self._active  # read once: a level switch lands between two calls
        cos, sin = self.rope.lookup(inp.positions)
        hidden = F.embedding(inp.input_ids, self.embed)  # [T, hidden], the residual stream
        layers = active.layers
        x = rms_norm(hidden, layers[0].input_norm, s.rms_norm_eps)
        for i, lw in enumerate(layers):
            qkv = lw.qkv(x)  # [T, (H + 2 KVH) D]
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
            x = add_rms_norm(hidden, lw.o(attn.reshape(t, h_dim)), lw.post_norm, s.rms_norm_eps)
            if lw.moe is not None:
                mlp_out = lw.moe(x)
            else:
                mlp_out = lw.down(silu_mul(lw.gate_up(x)))
            if i + 1 < len(layers):  # the residual add fused with the next layer's norm
                x = add_rms_norm(hidden, mlp_out, layers[i + 1].input_norm, s.rms_norm_eps)
            else:
                hidden.add_(mlp_out)
        last = rms_norm(hidden.index_select(0, inp.logits_indices), self.final_norm, s.rms_norm_eps)
        return active.lm_head(last).float()

    def _attention(self, layer: int, q: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        if self.attention_backend != "cpp":
            if inp.decode_only:  # static shapes: no read-back, capturable in a CUDA graph
                return paged_decode_attention(
                    q,
                    self.k_cache[layer],
                    self.v_cache[layer],
                    inp.block_tables,
                    inp.context_lens,
                    self.scale,
                )
            return paged_attention_torch(
                q,
                self.k_cache[layer],
                self.v_cache[layer],
                inp.block_tables,
                inp.query_start,
                inp.context_lens,
                self.scale,
                host_query_start=inp.host_query_start,
                host_context_lens=inp.host_context_lens,
            )
        return paged_attention(
            q.contiguous(),  # already, from the CPU's rope_write_kv
            self.k_cache[layer],
            self.v_cache[layer],
            inp.block_tables,
            inp.query_start,
            inp.context_lens,
            self.scale,
        )


def _qkv_bias(att) -> torch.Tensor | None:
    if att.q_proj.bias is None:
        return None
    return torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]).detach()


def _linear_bytes(layers: list[LayerWeights], lm_head: LinearLike) -> int:
    per_layer = sum(lin.nbytes for lw in layers for lin in lw.linears())
    return per_layer + lm_head.nbytes


def _pad(table: list[int], width: int) -> list[int]:
    # Padding points at block 0; attention reads no further than the context length.
    return table + [0] * (width - len(table))
