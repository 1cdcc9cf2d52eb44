"""Quantized weights in the planar layouts our kernels read, their torch reference, and
the weight-only int8 / int4 quantizers (`--quantization int8|int4`).

A decode step streams every weight, so 4-bit weights move a quarter of bf16's bytes.
GGUF's block formats interleave scales and codes (Q4_1: d, m, 16 bytes of nibbles per
32 values) row by row; our kernels want eight output rows side by side, one per
32-bit lane of a vector, and the scales apart. `QuantTensor` holds one [N, K] weight as

    q4  codes uint8 [N/8, K/32, 4, 8, 4]: [row tile, block, i, row, byte]; byte b holds
        value 4i+b of the row's block in its low nibble, 16+4i+b in its high nibble
        scales, mins [N/8, K/32, 8]                     w = scale * code + min
    q8  codes int8 [N/8, K/G, G/4, 8, 4]: [row tile, group, t, row, byte], value 4t+b
        scales [N/8, K/G, 8], G = 32 or 16              w = scale * code
    f8  codes float8_e4m3fn, laid out as q8; scales fp32 [N/8, K/G, 8], G a multiple
        of 32                                            w = scale * code

(rows padded to a multiple of 8 and K to 32, with zero scales). The mapping is exact for
every format we keep: Q4_0 is scale d, min -8 d (fp16, exact); Q4_1 d, m (fp16); Q4_K
scale d * sc and min -dmin * m (fp32: the products of an fp16 and a 6-bit integer);
Q8_0 d (fp16, G 32); Q5_0 codes q - 16, scale d (fp16, G 32); Q6_K codes q - 32, scale
d * sc (fp32, G 16). Other GGUF types (Q5_1, Q5_K, F16, ...) are dequantized at load.
`engine/weights/gguf_quant.py` re-lays GGUF blocks out; the kernels are
`kernels/csrc/qlinear_cpu.cpp` (CPU); elsewhere the torch reference
(`QuantTensor.dequantize`) runs.

FP8 weights (`f8`) keep a checkpoint's e4m3 bytes as they are. Published FP8
checkpoints scale per tensor, per output channel or per 128x128 block; each is held
here as one fp32 scale per row and group of G values (a block's scale repeated on its
128 rows; G the whole row for a per-tensor or per-channel scale), so fused projections
stack by rows whatever their block grid, and scales cost at most 4 bytes per 128
1-byte codes (3 %).
`kernels/csrc/fp8_linear_cpu.cpp` multiplies them without dequantizing the weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

ROWS = 8  # output rows side by side
BLOCK = 32  # values per activation block (and q4 block)


@dataclass(frozen=True)
class QuantTensor:
    """One [N, K] weight in a tiled quantized layout (see the module docstring)."""

    kind: str  # "q4" | "q8" | "f8"
    source: str  # the format it came from ("Q4_1", "int8", ...)
    shape: tuple[int, int]  # (N, K): the logical shape
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int  # values per scale

    @property
    def padded_k(self) -> int:
        return int(self.codes.shape[1]) * self.group

    @property
    def nbytes(self) -> int:
        planes = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(p.numel() * p.element_size() for p in planes)

    @property
    def layout_key(self) -> tuple[str, torch.dtype, int, int]:
        """Tensors with equal keys stack into one (`cat_rows`) if whole tiles."""
        return self.kind, self.scales.dtype, self.group, self.shape[1]

    def to(self, device: torch.device) -> QuantTensor:
        mins = self.mins.to(device) if self.mins is not None else None
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device),
                       mins=mins)  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype`: the torch reference every kernel is tested
        against."""
        return self.dequantize_rows(None, dtype)

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` (all if None) of the weight, [len(rows), K] in `dtype` (the
        embedding lookup of a quantized tied head reads only its rows)."""
        codes, scales, mins = self.unpacked(rows)
        w = codes.float().view(codes.shape[0], scales.shape[1], -1) * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.flatten(1)[:, : self.shape[1]].to(dtype)

    def unpacked(
        self, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows `rows` (default all) as integer codes [R, K'] (K' padded to 32) in value
        order, scales [R, K'/group] and mins (q4) [R, K'/32]."""
        if rows is None:
            rows = torch.arange(self.shape[0], device=self.codes.device)
        tile, lane = rows // ROWS, rows % ROWS
        codes = self.codes[tile, :, :, lane, :].flatten(2)  # [R, groups, 16 (q4) or G]
        if self.kind == "q4":
            codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1)
        mins = self.mins[tile, :, lane] if self.mins is not None else None
        return codes.flatten(1), self.scales[tile, :, lane], mins


def cat_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Stack weights of one layout along N (the fused qkv / gate_up projections); all
    but the last must fill whole row tiles."""
    first = parts[0]
    if any(p.layout_key != first.layout_key for p in parts) or any(
        p.shape[0] % ROWS for p in parts[:-1]
    ):
        raise ValueError("only weights of one quantized layout and whole row tiles stack")
    mins = torch.cat([p.mins for p in parts]) if first.mins is not None else None  # type: ignore[misc]
    source = "+".join(dict.fromkeys(p.source for p in parts))
    return replace(first, codes=torch.cat([p.codes for p in parts]),
                   scales=torch.cat([p.scales for p in parts]), mins=mins,
                   shape=(sum(p.shape[0] for p in parts), first.shape[1]),
                   source=source)  # fmt: skip


def _tile_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] padded with zero rows to whole tiles, viewed [N/8, 8, ...]."""
    n = t.shape[0]
    pad = -n % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, ROWS, *t.shape[1:])


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, source: str,
            k: int) -> QuantTensor:  # fmt: skip
    """codes [N, nb, 32] (values 0..15, any integer dtype), scales / mins [N, nb] -> a
    q4 tensor of logical width `k`."""
    n = codes.shape[0]
    c = codes.to(torch.uint8)
    gguf_bytes = c[..., :16] | (c[..., 16:] << 4)  # [N, nb, 16]: GGUF's qs, per row
    tiled = _tile_rows(gguf_bytes)
    tiled = tiled.view(*tiled.shape[:3], 4, 4)  # [N8, 8, nb, 4, 4]
    return QuantTensor(
        "q4", source, (n, k), tiled.permute(0, 2, 3, 1, 4).contiguous(),
        _tile_rows(scales).permute(0, 2, 1).contiguous(),
        _tile_rows(mins).permute(0, 2, 1).contiguous(), BLOCK,
    )  # fmt: skip


def pack_q8(codes: torch.Tensor, scales: torch.Tensor, group: int, source: str,
            k: int, kind: str = "q8") -> QuantTensor:  # fmt: skip
    """codes [N, K'] int8 (K' a multiple of 32), scales [N, K'/group] -> a q8 tensor of
    logical width `k`; with `kind` "f8", codes float8_e4m3fn and fp32 scales."""
    n, kp = codes.shape
    code_type = torch.float8_e4m3fn if kind == "f8" else torch.int8
    tiled = _tile_rows(codes.to(code_type)).view(-1, ROWS, kp // group, group // 4, 4)
    return QuantTensor(
        kind, source, (n, k), tiled.permute(0, 2, 3, 1, 4).contiguous(),
        _tile_rows(scales).permute(0, 2, 1).contiguous(), None, group,
    )  # fmt: skip


def _padded_to_block(w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(w.detach().float(), (0, -w.shape[1] % BLOCK))


def quantize_int8(w: torch.Tensor) -> QuantTensor:
    """Weight-only int8, symmetric, one scale per output channel (amax / 127; stored
    once per 32 values, the kernels' group)."""
    n, k = w.shape
    wf = _padded_to_block(w)
    scale = wf.abs().amax(dim=1, keepdim=True) / 127.0
    codes = torch.round(wf / scale.clamp_min(1e-30)).clamp_(-127, 127).to(torch.int8)
    return pack_q8(codes, scale.expand(n, wf.shape[1] // BLOCK), BLOCK, "int8", k)


def quantize_int4(w: torch.Tensor) -> QuantTensor:
    """Weight-only int4, asymmetric per group of 32 values: scale (max - min) / 15 and
    the group's min, both fp16 (as GGUF's Q4_1), codes rounded to the nearest level."""
    n, k = w.shape
    wf = _padded_to_block(w).view(n, -1, BLOCK)
    lo, hi = wf.amin(dim=2), wf.amax(dim=2)
    scale, low = ((hi - lo) / 15.0).half(), lo.half()
    s = scale.float().clamp_min(1e-30)[..., None]
    codes = torch.round((wf - low.float()[..., None]) / s).clamp_(0, 15)
    return pack_q4(codes, scale, low, "int4", k)


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def f8_group(k: int, block: int | None = None) -> int:
    """The group of an f8 weight `k` wide: the checkpoint's scale block (`block` values
    of K, a multiple of 32), or with one scale for all of K the whole row (padded to 32
    values), so a per-channel weight costs one fp32 scale a row."""
    if block is None:
        return -(-k // BLOCK) * BLOCK
    if block % BLOCK:
        raise ValueError(f"an FP8 scale block of {block} columns is not a multiple of 32")
    return block


def fp8_from_checkpoint(codes: torch.Tensor, scale: torch.Tensor, source: str,
                        block: tuple[int, int] | None = None) -> QuantTensor:  # fmt: skip
    """A published FP8 weight: codes [N, K] float8_e4m3fn and its scale, one of
    a scalar (per tensor), [N] or [N, 1] (per output channel), or, with `block`
    (rows, columns), [ceil(N/rows), ceil(K/columns)] (DeepSeek's and Qwen's 128x128
    `weight_scale_inv`, compressed-tensors' block strategy). w = scale * code."""
    if codes.dim() != 2 or codes.dtype != FP8:
        raise ValueError(f"an FP8 weight is a 2-D float8_e4m3fn tensor, got {codes.dtype} "
                         f"{tuple(codes.shape)}")  # fmt: skip
    n, k = codes.shape
    s = scale.detach().float()
    if block is not None:
        bn, bk = block
        grid = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != grid:
            raise ValueError(f"block scales of a {n}x{k} weight in {bn}x{bk} blocks are "
                             f"{grid}, got {tuple(s.shape)}")  # fmt: skip
        group = f8_group(k, bk)  # = bk: a block's columns are one group
        kp = grid[1] * group
        per_row = s.repeat_interleave(bn, dim=0)[:n]
    else:
        if s.numel() == 1:
            s = s.reshape(1).expand(n)
        elif s.numel() != n:
            raise ValueError(f"the scale of a {n}x{k} FP8 weight is a scalar or one per "
                             f"output row, got {tuple(s.shape)}")  # fmt: skip
        group = f8_group(k)
        kp = -(-k // group) * group
        per_row = s.reshape(n, 1).expand(n, kp // group)
    padded = torch.nn.functional.pad(codes.view(torch.uint8), (0, kp - k)).view(FP8)
    return pack_q8(padded, per_row.contiguous(), group, source, k, kind="f8")


def quantize_fp8(w: torch.Tensor) -> QuantTensor:
    """FP8 e4m3 at load (`--quantization fp8`): one scale per output channel (amax /
    448), codes rounded to nearest (torch's conversion)."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    codes = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return fp8_from_checkpoint(codes, scale, "fp8")
