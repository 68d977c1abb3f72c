"""The organizers' muse_moe_w4a16 (issue 18): the W4A16 experts in two or three Triton kernels, on the tensor
cores or, where every expert sees one token, on the CUDA cores.

At decode sizes (M = 1-32 tokens, 8 experts each) every used expert sees one to a few tokens, and the
time is reading its int4 weights once. The production kernel (SGLang's fused_moe, the baseline) tiles
tokens as the dot's M side, padded to 16 rows per expert, and runs five kernels (align, gate/up, SiLU,
down, top-k sum). Here, per M (CONFIGS, searched on the GPU by `python benchmarks/tune_solutions.py
muse_moe_w4a16 --write`):

PATH "tc", the tensor cores:
1. `_route` (one program, up to MAX_PAIRS pairs): the (token, expert) pairs sorted by expert with one
   `tl.sort` of the keys expert * NP + pair, each expert's run cut into blocks of at most BT pairs; a block
   is (its first sorted position, its expert), so nothing is padded and the grid is bounded by
   min(E, pairs) + pairs / BT blocks. More pairs (prefill): `_count` ranks each pair among its expert's by
   an atomic count, `_cut` scans the counts and cuts the runs into blocks, `_scatter` places the pairs.
2. `_gate_up`: per block and BN columns of the intermediate, acc[BN, BT] = W[BN, K] @ x^T[K, BT] (or, ROWS,
   acc[BT, BN] = x[BT, K] @ W^T: the production orientation), the int4 nibbles unpacked four bytes per
   32-bit word in PTX (the bf16 pattern 0x4300 or'ed onto each nibble is 128 + n; minus 136 in bf16x2),
   the low nibbles (even k) and the high (odd k) dotted with x's even and odd k as they are (no
   interleave), the weights loaded without a mask (rows past the end clamped), and at decode's BT <= 32
   the group's scale applied to the dots' float32 sums (POST): 2.4-2.8 SASS instructions a weight in the
   K loop against 5.0-5.4 with all three undone (benchmarks/static_kernels.py; the production kernel's
   5.8-6.3). SiLU(gate) * up fused. With SPLIT_UP > 1 the K
   range is shared and the last program of a tile to take its ticket adds the fp32 parts in split order
   and applies the SiLU (deterministic, no second kernel).
3. `_down`: the same over K = I, each pair's row scaled by its top-k weight and written as an fp32 part;
   the last of a token's TOPK * SPLIT_DOWN parts to arrive (a ticket per token and column tile) sums them
   in a fixed order and stores the token's bf16 row: the top-k reduction needs no kernel of its own.
   Tickets are int32 counters kept between calls; the program that finishes a tile sets its counter back
   to zero, so every call (and every CUDA-graph replay) starts from zero.

PATH "cc", the CUDA cores (M1: one token an expert, the tensor cores' tile would be 15/16 padding):
`_gate_up_cc` unpacks BN gate and up rows into float32 (a nibble or'ed into the float pattern of 2^23 is
2^23 + n; one subtraction of 2^23 + 8) and dots them with each of its block's tokens, SiLU fused;
`_down_cc` walks a token's TOPK experts in a fixed order and stores its row once (an optional residual
added). PREFETCH issues the next step's loads before this step's arithmetic (Triton pipelines only the
loads that feed a tl.dot). UNPACK "words" (`_gate_up_words`, `_down_words`, one pair a program row): the
weights read as 32-bit words, nibble J of a word shifted to bits 16-19 and or'ed into the pattern of 1.0
(1 + n/128, exact), one fma a weight into an accumulator per (row, word); a group's sum_k (n_k - 8) x_k is
128 * sum_k (1 + n_k/128) x_k - 136 * sum_k x_k, the second shared by every row. 3.8 instructions a
weight in gate/up's K loop and 4.9 in down's (at 4 rows a thread) against the bytes' 6.8-9.5 (SASS,
benchmarks/static_kernels.py): at M1 the GEMV is bound by the SMs' issue rate, not by the memory.

Launches (PATH "tc"): SORT 0 skips _route where sorting groups nothing (M1: each expert has its one pair; block
b is pair b, its expert read from the router's ids), and PDL launches _gate_up and _down with Hopper's
programmatic dependent launch, each waiting on the device (gdc_wait) for the kernel before it to end before it
reads anything; the call's first kernel is always a plain launch, so a call never overlaps the one before it.

Every kernel takes a weight row's bytes as an argument (ROW), so the JIT sees its divisibility by 16 and
loads 16 bytes a thread. On a CPU (Triton's interpreter: no PTX, a wrong bf16 dot) the dots run in float32
and the bf16 roundings are done by hand.
"""

from math import gcd

import torch
import triton
import triton.language as tl

# M (the nearest tuned) -> block sizes; BT tokens per block (the dot's narrow side, 16 at least).
# searched on NVIDIA H100 80GB HBM3, 2026-12-06 (benchmarks/tune_solutions.py --write)
CONFIGS = {
    1: {
        "PATH": "tc",
        "BT": 16,
        "BN_UP": 32,
        "GPS_UP": 2,
        "warps_up": 2,
        "stages_up": 3,
        "BN_DOWN": 64,
        "GPS_DOWN": 1,
        "warps_down": 2,
        "stages_down": 3,
        "UNPACK": "bytes",
        "PREFETCH": 1,
        "ROWS": 1,
        "SPLIT_UP": 2,
        "SPLIT_DOWN": 1,
        "maxnreg_up": 168,
        "maxnreg_down": 0,
        "SORT": 0,
        "PDL": 1,
    },
    16: {
        "PATH": "tc",
        "BT": 16,
        "BN_UP": 32,
        "SPLIT_UP": 1,
        "warps_up": 2,
        "stages_up": 3,
        "BN_DOWN": 64,
        "SPLIT_DOWN": 1,
        "warps_down": 2,
        "stages_down": 5,
        "GPS_UP": 2,
        "GPS_DOWN": 2,
        "ROWS": 0,
        "maxnreg_up": 168,
        "maxnreg_down": 0,
        "PDL": 1,
    },
    32: {
        "PATH": "tc",
        "BT": 16,
        "BN_UP": 32,
        "SPLIT_UP": 1,
        "warps_up": 4,
        "stages_up": 5,
        "BN_DOWN": 128,
        "SPLIT_DOWN": 1,
        "warps_down": 4,
        "stages_down": 5,
        "GPS_UP": 2,
        "GPS_DOWN": 2,
        "ROWS": 1,
        "maxnreg_up": 128,
        "maxnreg_down": 0,
        "PDL": 0,
    },
}
ONE = 0x3F800000  # the bit pattern of float32 1.0 (the words' unpacking; an argument, see _nib)
MAX_PAIRS = 1024  # one _route program sorts up to this many pairs in registers; more are counted and scattered


@triton.jit
def _bf16_rne(v):
    """float32 -> bf16, round to nearest even, by hand (the interpreter's cast truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _route(ids_ptr, spair_ptr, sexp_ptr, bstart_ptr, bexp_ptr, nblk_ptr, n_pairs, NP: tl.constexpr,
           BT: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # _gate_up may be launched now (it waits on the device for this grid's end before reading)
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.arange(0, NP)
    live = i < n_pairs
    e = tl.load(ids_ptr + i, mask=live, other=0x7FFF)  # past the end: after every real expert
    keys = tl.sort(e * NP + i)  # by expert, then by pair: a stable order
    e_s = keys // NP
    pair_s = keys % NP
    tl.store(spair_ptr + i, pair_s, mask=live)
    tl.store(sexp_ptr + i, e_s, mask=live)
    tl.debug_barrier()  # the sorted experts are in memory before each lane reads its neighbour's
    prev = tl.load(sexp_ptr + i - 1, mask=live & (i > 0), other=-1)
    run_start = tl.associative_scan(tl.where(e_s != prev, i, 0), 0, _max_combine)
    opens = live & ((i - run_start) % BT == 0)
    blk = tl.cumsum(opens.to(tl.int32), 0) - 1
    tl.store(bstart_ptr + blk, i, mask=opens)
    tl.store(bexp_ptr + blk, e_s, mask=opens)
    tl.store(nblk_ptr, tl.sum(opens.to(tl.int32), 0))


@triton.jit
def _count(ids_ptr, counts_ptr, rank_ptr, n_pairs, BLOCK: tl.constexpr):
    """Many pairs (prefill): each pair's rank among its expert's pairs, by an atomic count per expert."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_pairs
    e = tl.load(ids_ptr + i, mask=ok, other=0)
    tl.store(rank_ptr + i, tl.atomic_add(counts_ptr + e, 1, mask=ok), mask=ok)


@triton.jit
def _cut(counts_ptr, estart_ptr, bfirst_ptr, bstart_ptr, bexp_ptr, nblk_ptr, E, max_blocks, EB: tl.constexpr,
         BT: tl.constexpr, CH: tl.constexpr):
    """One program: each expert's first sorted position (an exclusive scan of the counts), and its run cut
    into blocks of at most BT pairs, blocks numbered expert after expert."""
    e = tl.arange(0, EB)
    ok = e < E
    c = tl.load(counts_ptr + e, mask=ok, other=0)
    nb = (c + BT - 1) // BT
    ends = tl.cumsum(nb, 0)  # an expert's blocks end here (exclusive)
    tl.store(estart_ptr + e, tl.cumsum(c, 0) - c, mask=ok)
    tl.store(bfirst_ptr + e, ends - nb, mask=ok)
    total = tl.sum(nb, 0)
    tl.store(nblk_ptr, total)
    tl.debug_barrier()  # the scans are in memory before any lane reads another expert's
    ends = tl.where(ok, ends, 1 << 30)
    for b0 in range(0, max_blocks, CH):
        b = b0 + tl.arange(0, CH)
        live = b < total
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), 1)  # experts whose blocks all come before b
        first = tl.load(bfirst_ptr + owner, mask=live, other=0)
        tl.store(bstart_ptr + b, tl.load(estart_ptr + owner, mask=live, other=0) + (b - first) * BT, mask=live)
        tl.store(bexp_ptr + b, owner, mask=live)


@triton.jit
def _scatter(ids_ptr, rank_ptr, estart_ptr, spair_ptr, sexp_ptr, n_pairs, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_pairs
    e = tl.load(ids_ptr + i, mask=ok, other=0)
    at = tl.load(estart_ptr + e, mask=ok, other=0) + tl.load(rank_ptr + i, mask=ok, other=0)
    tl.store(spair_ptr + at, i, mask=ok)
    tl.store(sexp_ptr + at, e, mask=ok)


@triton.jit
def _dequant(packed, scale, SCALED: tl.constexpr):
    """(lo, hi): bf16 (n - 8) of each byte's low / high nibble, times `scale` (bf16 of packed's shape, one
    rounding of the product) where SCALED; exact without."""
    if SCALED:
        out = tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, c, d, k;
            mov.b32 k, 0x43084308;
            prmt.b32 a, $4, 0, 0x4140;
            prmt.b32 b, $4, 0, 0x4342;
            shr.u32 c, a, 4;
            shr.u32 d, b, 4;
            lop3.b32 a, a, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 b, b, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 c, c, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 d, d, 0x000F000F, 0x43004300, 0xEA;
            sub.rn.bf16x2 a, a, k;
            sub.rn.bf16x2 b, b, k;
            sub.rn.bf16x2 c, c, k;
            sub.rn.bf16x2 d, d, k;
            mul.rn.bf16x2 $0, a, $5;
            mul.rn.bf16x2 $1, b, $6;
            mul.rn.bf16x2 $2, c, $5;
            mul.rn.bf16x2 $3, d, $6;
            }""",
            "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, c, d, k;
            mov.b32 k, 0x43084308;
            prmt.b32 a, $4, 0, 0x4140;
            prmt.b32 b, $4, 0, 0x4342;
            shr.u32 c, a, 4;
            shr.u32 d, b, 4;
            lop3.b32 a, a, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 b, b, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 c, c, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 d, d, 0x000F000F, 0x43004300, 0xEA;
            sub.rn.bf16x2 $0, a, k;
            sub.rn.bf16x2 $1, b, k;
            sub.rn.bf16x2 $2, c, k;
            sub.rn.bf16x2 $3, d, k;
            }""",
            "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return out


@triton.jit
def _mac(acc, packed, scale, xt, F32: tl.constexpr, ROWS: tl.constexpr, POST: tl.constexpr):
    """acc [BN, BT] + W [BN, GROUP] @ xt [GROUP, BT]: W the tile `packed` [BN, GROUP // 2] of one
    quantisation group (low nibble first along K) times its scales `scale` [BN].
    ROWS: the tokens as the dot's first operand instead, acc [BT, BN] + xt [BT, GROUP] @ W^T (the
    production kernel's orientation; the tokens' rows load along K).
    Two dots of K = GROUP / 2, by k's parity: the low nibbles (even k) against x's even k, the high (odd k)
    against its odd k. The unpacked halves go to the tensor cores as they are; interleaving them back into
    k's order cost ~1.6 PRMTs a weight in SASS (benchmarks/static_kernels.py), x's split costs nothing.
    POST: the dots take the exact n - 8 and the group's scale multiplies their float32 sums (one FFMA an
    accumulator a group: BT / GROUP a weight, against the 0.5 a weight of bf16x2 multiplies it saves; for
    decode's BT <= 32). Without, each weight is rounded to bf16 as (n - 8) * scale, as the production
    kernel does."""
    if ROWS:
        xe, xo = tl.split(xt.reshape(xt.shape[0], xt.shape[1] // 2, 2))
    else:
        xe, xo = tl.split(tl.permute(xt.reshape(xt.shape[0] // 2, 2, xt.shape[1]), (0, 2, 1)))
    # (if / else, never an early return: Triton's compiler would also build the code after a returning branch)
    if F32:
        s = scale.to(tl.float32)[:, None]
        lo = ((packed & 0xF).to(tl.int32) - 8).to(tl.float32)
        hi = ((packed >> 4).to(tl.int32) - 8).to(tl.float32)
        if not POST:
            lo = _bf16_rne(lo * s).to(tl.float32)
            hi = _bf16_rne(hi * s).to(tl.float32)
        xe = xe.to(tl.float32)
        xo = xo.to(tl.float32)
    else:
        lo, hi = _dequant(packed, tl.broadcast_to(scale[:, None], packed.shape), not POST)
    if POST:
        sc = scale.to(tl.float32)
        if ROWS:
            out = acc + tl.dot(xo, tl.trans(hi), tl.dot(xe, tl.trans(lo))) * sc[None, :]
        else:
            out = acc + tl.dot(hi, xo, tl.dot(lo, xe)) * sc[:, None]
    elif ROWS:
        out = tl.dot(xo, tl.trans(hi), tl.dot(xe, tl.trans(lo), acc))
    else:
        out = tl.dot(hi, xo, tl.dot(lo, xe, acc))
    return out


@triton.jit
def _block(b, bstart_ptr, bexp_ptr, spair_ptr, sexp_ptr, n_pairs, BT: tl.constexpr, SORTED: tl.constexpr = True):
    """Block b's expert, its pairs [BT] and which of them are its own. Unsorted (no _route: M1, where every
    expert has one pair), block b is pair b alone and sexp_ptr the experts as the router chose them."""
    if SORTED:
        e = tl.load(bexp_ptr + b)
        r = tl.load(bstart_ptr + b) + tl.arange(0, BT)
        inside = r < n_pairs
        mine = inside & (tl.load(sexp_ptr + r, mask=inside, other=-1) == e)
        pair = tl.load(spair_ptr + r, mask=mine, other=0)
    else:
        e = tl.load(sexp_ptr + b)
        mine = tl.arange(0, BT) == 0
        pair = tl.where(mine, b, 0)
    return e.to(tl.int64), pair, mine


@triton.jit
def _parts_sum(at, stride, mask, SPLIT: tl.constexpr):
    """The SPLIT float32 parts at `at + i * stride` added in split order, whichever program arrived last
    (deterministic); loaded past L1 (.cg), where a line read before the other parts were written may sit."""
    total = tl.zeros(at.shape, dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        total += tl.load(at + i * stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _gate_up(x_ptr, w_ptr, s_ptr, spair_ptr, sexp_ptr, bstart_ptr, bexp_ptr, nblk_ptr, act_ptr, part_ptr,
             ticket_ptr, n_pairs, H, I, G, ROW, TOPK: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
             GROUP: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr, ROWS: tl.constexpr, POST: tl.constexpr,
             PDL: tl.constexpr = False, SORTED: tl.constexpr = True):
    if PDL:  # launched while _route ran: wait for its end and its writes, then let _down be launched
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    if SORTED:
        if b >= tl.load(nblk_ptr):
            return
    e, pair, mine = _block(b, bstart_ptr, bexp_ptr, spair_ptr, sexp_ptr, n_pairs, BT, SORTED)
    tok = (pair // TOPK).to(tl.int64)
    tile = tl.program_id(1)
    rn = tile * BN + tl.arange(0, BN)
    n_ok = rn < I
    rk = tl.arange(0, GROUP)
    half = tl.arange(0, GROUP // 2)
    # rows past the end read the last row's (their results are never stored): the weights' loads need no
    # mask, whose per-byte select and repacking cost ~1.5 instructions a weight (SASS)
    gate_rows = w_ptr + e * (2 * I) * ROW + tl.minimum(rn, I - 1)[:, None].to(tl.int64) * ROW
    up_rows = gate_rows + I * ROW
    gate_s = s_ptr + e * (2 * I) * G + rn * G
    up_s = gate_s + I * G
    if ROWS:
        acc_g = tl.zeros((BT, BN), dtype=tl.float32)
        acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BN, BT), dtype=tl.float32)
        acc_u = tl.zeros((BN, BT), dtype=tl.float32)
    sp = tl.program_id(2)
    for g in range(sp * (G // SPLIT), (sp + 1) * (G // SPLIT)):
        if ROWS:
            xt = tl.load(x_ptr + tok[:, None] * H + (g * GROUP + rk)[None, :], mask=mine[:, None], other=0.0)
        else:
            xt = tl.load(x_ptr + tok[None, :] * H + (g * GROUP + rk)[:, None], mask=mine[None, :], other=0.0)
        cols = (g * (GROUP // 2) + half)[None, :]
        pg = tl.load(gate_rows + cols)
        pu = tl.load(up_rows + cols)
        acc_g = _mac(acc_g, pg, tl.load(gate_s + g, mask=n_ok, other=0.0), xt, F32, ROWS, POST)
        acc_u = _mac(acc_u, pu, tl.load(up_s + g, mask=n_ok, other=0.0), xt, F32, ROWS, POST)
    if ROWS:  # back to [BN, BT] for the epilogue
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    keep = n_ok[:, None] & mine[None, :]
    out_at = act_ptr + pair[None, :].to(tl.int64) * I + rn[:, None]
    if SPLIT == 1:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(out_at, _bf16_rne(act) if F32 else act.to(tl.bfloat16), mask=keep)
    else:
        part_at = part_ptr + pair[None, :].to(tl.int64) * (2 * I) + rn[:, None]
        stride = n_pairs * 2 * I
        tl.store(part_at + sp * stride, acc_g, mask=keep)
        tl.store(part_at + sp * stride + I, acc_u, mask=keep)
        tl.debug_barrier()  # the whole part is written before the ticket is taken (release)
        ticket = ticket_ptr + b * tl.num_programs(1) + tile
        if tl.atomic_add(ticket, 1, sem="acq_rel") == SPLIT - 1:
            gs = _parts_sum(part_at, stride, keep, SPLIT)
            us = _parts_sum(part_at + I, stride, keep, SPLIT)
            act = gs / (1.0 + tl.exp(-gs)) * us
            tl.store(out_at, _bf16_rne(act) if F32 else act.to(tl.bfloat16), mask=keep)
            tl.atomic_xchg(ticket, 0)


@triton.jit
def _down(act_ptr, w_ptr, s_ptr, tw_ptr, spair_ptr, sexp_ptr, bstart_ptr, bexp_ptr, nblk_ptr, part_ptr,
          ticket_ptr, out_ptr, n_pairs, H, I, G, ROW, TOPK: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
          GROUP: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr, ROWS: tl.constexpr, POST: tl.constexpr,
          PDL: tl.constexpr = False, SORTED: tl.constexpr = True):
    if PDL:  # launched while _gate_up ran: wait for its end and its writes before reading anything
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    if SORTED:
        if b >= tl.load(nblk_ptr):
            return
    e, pair, mine = _block(b, bstart_ptr, bexp_ptr, spair_ptr, sexp_ptr, n_pairs, BT, SORTED)
    pair = pair.to(tl.int64)
    tile = tl.program_id(1)
    rn = tile * BN + tl.arange(0, BN)
    n_ok = rn < H
    rk = tl.arange(0, GROUP)
    half = tl.arange(0, GROUP // 2)
    rows = w_ptr + e * H * ROW + tl.minimum(rn, H - 1)[:, None].to(tl.int64) * ROW  # no mask (see _gate_up)
    scales = s_ptr + e * H * G + rn * G
    acc = tl.zeros((BT, BN) if ROWS else (BN, BT), dtype=tl.float32)
    sp = tl.program_id(2)
    for g in range(sp * (G // SPLIT), (sp + 1) * (G // SPLIT)):
        if ROWS:
            at = tl.load(act_ptr + pair[:, None] * I + (g * GROUP + rk)[None, :], mask=mine[:, None], other=0.0)
        else:
            at = tl.load(act_ptr + pair[None, :] * I + (g * GROUP + rk)[:, None], mask=mine[None, :], other=0.0)
        p = tl.load(rows + (g * (GROUP // 2) + half)[None, :])
        acc = _mac(acc, p, tl.load(scales + g, mask=n_ok, other=0.0), at, F32, ROWS, POST)
    if ROWS:
        acc = tl.trans(acc)
    acc = acc * tl.load(tw_ptr + pair, mask=mine, other=0.0)[None, :]
    keep = n_ok[:, None] & mine[None, :]
    stride = n_pairs * H
    tl.store(part_ptr + sp * stride + pair[None, :] * H + rn[:, None], acc, mask=keep)
    tl.debug_barrier()  # the whole part is written before the tickets are taken (release)
    tok = pair // TOPK  # a block's pairs are of distinct tokens (a token's experts are distinct)
    tickets = ticket_ptr + tok * tl.num_programs(1) + tile
    last = mine & (tl.atomic_add(tickets, 1, mask=mine, sem="acq_rel") == TOPK * SPLIT - 1)
    if tl.sum(last.to(tl.int32), 0) > 0:
        total = tl.zeros((BN, BT), dtype=tl.float32)
        done = n_ok[:, None] & last[None, :]
        for i in tl.static_range(SPLIT):  # a fixed order: split, then the token's k
            for k in tl.static_range(TOPK):
                total += tl.load(part_ptr + i * stride + (tok * TOPK + k)[None, :] * H + rn[:, None], mask=done,
                                 other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + tok[None, :] * H + rn[:, None], _bf16_rne(total) if F32 else total.to(tl.bfloat16),
                 mask=done)
        tl.atomic_xchg(tickets, 0, mask=last)


@triton.jit
def _nibbles(packed):
    """(lo, hi) float32 (n - 8) of each byte's low / high nibble: a nibble or'ed into the float pattern of
    2^23 is 2^23 + n, exact, and one subtraction takes 2^23 + 8 off (no int -> float conversion)."""
    w = packed.to(tl.int32)
    lo = ((w & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    hi = ((w >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi


@triton.jit
def _row_dot(lo, hi, scale, v_ptr, GPS: tl.constexpr, HALF: tl.constexpr):
    """[BN]: sum over a step's GPS groups of scale[n, g] * sum_j (lo[n, g, j] v[2j] + hi[n, g, j] v[2j+1]),
    v the step's 2 * GPS * HALF activations from v_ptr (even k on the low nibble)."""
    v = tl.load(v_ptr + tl.arange(0, 2 * GPS * HALF)).to(tl.float32)  # contiguous, then split even / odd
    ve, vo = tl.split(v.reshape(GPS, HALF, 2))
    return tl.sum(tl.sum(lo * ve[None, :, :] + hi * vo[None, :, :], 2) * scale, 1)


@triton.jit
def _load_step(rows, scales, s, ok, GPS: tl.constexpr, HALF: tl.constexpr):
    """Step s of BN weight rows (the rows where `ok`): the packed bytes [BN, GPS, HALF] and the scales
    [BN, GPS] of its GPS quantisation groups."""
    gi = tl.arange(0, GPS)
    cols = (s * GPS + gi)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    packed = tl.load(rows[:, None, None] + cols[None, :, :], mask=ok[:, None, None], other=0x88)
    return packed, tl.load(scales[:, None] + (s * GPS + gi)[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _gate_up_cc(x_ptr, w_ptr, s_ptr, spair_ptr, sexp_ptr, bstart_ptr, bexp_ptr, nblk_ptr, ids_ptr, act_ptr,
                n_pairs, H, I, G, ROW, TOPK: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                GROUP: tl.constexpr, GPS: tl.constexpr, SORTED: tl.constexpr, PREFETCH: tl.constexpr):
    """CUDA cores, no tensor-core tile: per block (one expert, its `cnt` <= BT pairs) and BN rows of the
    intermediate, the gate and up rows are unpacked once per step into float32 and dotted with each pair's
    token in turn; SiLU(gate) * up stored in float32. Unsorted (SORTED = 0): a block is one pair.
    PREFETCH: the next step's bytes are requested before this step's arithmetic (two steps in flight)."""
    b = tl.program_id(0)
    if SORTED:
        if b >= tl.load(nblk_ptr):
            return
        e, _, mine = _block(b, bstart_ptr, bexp_ptr, spair_ptr, sexp_ptr, n_pairs, BT)
        start = tl.load(bstart_ptr + b)
        cnt = tl.sum(mine.to(tl.int32), 0)  # a run is contiguous: its pairs are a prefix of the slots
    else:
        e = tl.load(ids_ptr + b).to(tl.int64)
        start = b
        cnt = 1
    HALF: tl.constexpr = GROUP // 2
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < I
    gate_rows = w_ptr + e * (2 * I) * ROW + rn.to(tl.int64) * ROW
    up_rows = gate_rows + I * ROW
    gate_s = s_ptr + e * (2 * I) * G + rn * G
    up_s = gate_s + I * G
    slot = tl.arange(0, BT)
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    steps = G // GPS
    pg, sg = _load_step(gate_rows, gate_s, 0, n_ok, GPS, HALF)
    pu, su = _load_step(up_rows, up_s, 0, n_ok, GPS, HALF)
    for s in range(0, steps):
        more = n_ok & (rn * 0 + s + 1 < steps)  # a tensor: the interpreter's s is a Python int
        if PREFETCH:
            pg_next, sg_next = _load_step(gate_rows, gate_s, s + 1, more, GPS, HALF)
            pu_next, su_next = _load_step(up_rows, up_s, s + 1, more, GPS, HALF)
        glo, ghi = _nibbles(pg)
        ulo, uhi = _nibbles(pu)
        for i in range(cnt):
            pair = tl.load(spair_ptr + start + i) if SORTED else start
            xs = x_ptr + (pair // TOPK).to(tl.int64) * H + s * GPS * GROUP
            dg = _row_dot(glo, ghi, sg.to(tl.float32), xs, GPS, HALF)
            du = _row_dot(ulo, uhi, su.to(tl.float32), xs, GPS, HALF)
            acc_g = tl.where(slot[:, None] == i, acc_g + dg[None, :], acc_g)
            acc_u = tl.where(slot[:, None] == i, acc_u + du[None, :], acc_u)
        if PREFETCH:
            pg, sg, pu, su = pg_next, sg_next, pu_next, su_next
        else:
            pg, sg = _load_step(gate_rows, gate_s, s + 1, more, GPS, HALF)
            pu, su = _load_step(up_rows, up_s, s + 1, more, GPS, HALF)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if SORTED:
        pairs = tl.load(spair_ptr + start + slot, mask=slot < cnt, other=0)
    else:
        pairs = start + slot
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * I + rn[None, :], act, mask=(slot < cnt)[:, None] & n_ok[None, :])


@triton.jit
def _down_cc(act_ptr, w_ptr, s_ptr, tw_ptr, ids_ptr, res_ptr, out_ptr, H, I, G, ROW, TOPK: tl.constexpr,
             BN: tl.constexpr, GROUP: tl.constexpr, GPS: tl.constexpr, HAS_RES: tl.constexpr,
             PREFETCH: tl.constexpr):
    """CUDA cores: per token and BN output columns, the token's TOPK experts one after the other (a fixed
    order: deterministic, no parts, no atomics), each expert's rows unpacked into float32 and dotted with
    the pair's float32 activation times its weight; the sum (plus the residual) stored as the token's bf16
    row. One loop over (expert, step), so PREFETCH runs on across the experts."""
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = GROUP // 2
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < H
    row_off = rn.to(tl.int64) * ROW
    steps = G // GPS
    acc = tl.zeros((BN,), dtype=tl.float32)
    e = tl.load(ids_ptr + t * TOPK).to(tl.int64)
    p, sc = _load_step(w_ptr + e * H * ROW + row_off, s_ptr + e * H * G + rn * G, 0, n_ok, GPS, HALF)
    for it in range(0, TOPK * steps):
        pair = t * TOPK + it // steps
        s = it % steps
        nxt = it + 1
        more = n_ok & (rn * 0 + nxt < TOPK * steps)
        e_next = tl.load(ids_ptr + t * TOPK + nxt // steps, mask=nxt < TOPK * steps, other=0).to(tl.int64)
        rows_next = w_ptr + e_next * H * ROW + row_off
        scales_next = s_ptr + e_next * H * G + rn * G
        if PREFETCH:
            p_next, sc_next = _load_step(rows_next, scales_next, nxt % steps, more, GPS, HALF)
        lo, hi = _nibbles(p)
        acc += tl.load(tw_ptr + pair) * _row_dot(lo, hi, sc.to(tl.float32), act_ptr + pair * I + s * GPS * GROUP,
                                                 GPS, HALF)
        if PREFETCH:
            p, sc = p_next, sc_next
        else:
            p, sc = _load_step(rows_next, scales_next, nxt % steps, more, GPS, HALF)
    if HAS_RES:
        acc += tl.load(res_ptr + t * H + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + rn, acc.to(tl.bfloat16), mask=n_ok)


@triton.jit
def _nib(words, ONE, J: tl.constexpr):
    """float32 1 + n/128 for nibble J of each 32-bit word (k = 8w + J: byte J // 2, low nibble first): the
    nibble shifted to bits 16-19 and or'ed into ONE, the pattern of 1.0 (0x3F800000), exact. Two
    instructions a weight (a shift, a lop3; none for J = 4) where _nibbles' bytes take four or five. ONE is
    a kernel argument, not a literal: the lop3 then reads it from the constant bank beside the mask's
    immediate, where a second literal is rematerialised into a register, ~40 MOVs a trip (SASS)."""
    if J < 4:
        v = words << (16 - 4 * J)
    elif J > 4:
        v = words >> (4 * J - 16)
    else:
        v = words
    return ((v & 0x000F0000) | ONE).to(tl.float32, bitcast=True)


@triton.jit
def _words_step(words, x_ptr, ONE, GPS: tl.constexpr, WG: tl.constexpr):
    """For the step's words [BN, GPS, WG] (WG 32-bit words a quantisation group) and its 8 * GPS * WG
    activations from x_ptr: ([BN, GPS] sum_k (1 + n_k/128) x_k, [GPS] sum_k x_k) per group. Each weight
    costs one fma into an accumulator per (row, word) (no reduction per weight); the caller takes
    sum_k (n_k - 8) x_k = 128 * the first - 136 * the second, times the group's scale."""
    xb = x_ptr + tl.arange(0, GPS)[:, None] * (8 * WG) + 8 * tl.arange(0, WG)[None, :]
    acc = tl.zeros(words.shape, dtype=tl.float32)
    xsum = tl.zeros((GPS, WG), dtype=tl.float32)
    for J in tl.static_range(8):
        xj = tl.load(xb + J).to(tl.float32)
        xsum += xj
        acc += _nib(words, ONE, J) * xj[None, :, :]
    return tl.sum(acc, 2), tl.sum(xsum, 1)


@triton.jit
def _load_words(rows, scales, s, ok, GPS: tl.constexpr, WG: tl.constexpr):
    """Step s of BN rows given as int32 word pointers: the words [BN, GPS, WG] and the scales [BN, GPS]."""
    gi = tl.arange(0, GPS)
    cols = (s * GPS + gi)[:, None] * WG + tl.arange(0, WG)[None, :]
    words = tl.load(rows[:, None, None] + cols[None, :, :], mask=ok[:, None, None], other=0)
    return words, tl.load(scales[:, None] + (s * GPS + gi)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _gate_up_words(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, part_ptr, ticket_ptr, n_pairs, H, I, G, ROW, ONE,
                   TOPK: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, GPS: tl.constexpr,
                   SPLIT: tl.constexpr):
    """CUDA cores, one pair a program row (M1): BN gate and up rows of the pair's expert read as 32-bit words
    and unpacked by _nib (1 + n/128, the -8 and the 1 taken off per group through sum_k x_k), one fma a
    weight; SiLU(gate) * up stored in float32. With SPLIT > 1 the K range is shared by SPLIT programs (M1
    has 8 x I rows for 132 SMs): each writes its float32 gate and up parts, and the last of a tile's SPLIT
    to take its ticket adds them in split order (deterministic) and applies the SiLU."""
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    WG: tl.constexpr = GROUP // 8
    RW = ROW // 4
    tile = tl.program_id(1)
    rn = tile * BN + tl.arange(0, BN)
    n_ok = rn < I
    g_rows = w_ptr.to(tl.pointer_type(tl.int32)) + (e * (2 * I) + rn.to(tl.int64)) * RW
    u_rows = g_rows + I * RW
    g_s = s_ptr + e * (2 * I) * G + rn * G
    u_s = g_s + I * G
    x_row = x_ptr + (p // TOPK).to(tl.int64) * H
    out_g = tl.zeros((BN,), dtype=tl.float32)
    out_u = tl.zeros((BN,), dtype=tl.float32)
    sp = tl.program_id(2)
    steps = G // GPS // SPLIT
    for s in range(sp * steps, (sp + 1) * steps):
        wg, sg = _load_words(g_rows, g_s, s, n_ok, GPS, WG)
        wu, su = _load_words(u_rows, u_s, s, n_ok, GPS, WG)
        dg, sx = _words_step(wg, x_row + s * GPS * GROUP, ONE, GPS, WG)
        du, _ = _words_step(wu, x_row + s * GPS * GROUP, ONE, GPS, WG)
        out_g += tl.sum(sg * (128.0 * dg - 136.0 * sx[None, :]), 1)
        out_u += tl.sum(su * (128.0 * du - 136.0 * sx[None, :]), 1)
    out_at = act_ptr + p.to(tl.int64) * I + rn
    if SPLIT == 1:
        tl.store(out_at, out_g / (1.0 + tl.exp(-out_g)) * out_u, mask=n_ok)
    else:
        part_at = part_ptr + p.to(tl.int64) * (2 * I) + rn
        stride = n_pairs * 2 * I
        tl.store(part_at + sp * stride, out_g, mask=n_ok)
        tl.store(part_at + sp * stride + I, out_u, mask=n_ok)
        tl.debug_barrier()  # the whole part is written before the ticket is taken (release)
        ticket = ticket_ptr + p * tl.num_programs(1) + tile
        if tl.atomic_add(ticket, 1, sem="acq_rel") == SPLIT - 1:
            gs = _parts_sum(part_at, stride, n_ok, SPLIT)
            us = _parts_sum(part_at + I, stride, n_ok, SPLIT)
            tl.store(out_at, gs / (1.0 + tl.exp(-gs)) * us, mask=n_ok)
            tl.atomic_xchg(ticket, 0)


@triton.jit
def _down_words(act_ptr, w_ptr, s_ptr, tw_ptr, ids_ptr, res_ptr, part_ptr, ticket_ptr, out_ptr, M, H, I, G, ROW,
                ONE, TOPK: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, GPS: tl.constexpr,
                HAS_RES: tl.constexpr, SPLIT: tl.constexpr):
    """_down_cc with the words' unpacking: per token and BN output columns, its TOPK experts in a fixed
    order, each pair's float32 activation dotted with the expert's rows, times its weight; one bf16 store.
    With SPLIT > 1 the experts are shared by SPLIT programs (TOPK / SPLIT each: M1 has one token, so H / BN
    programs otherwise), each writing a float32 part; the last of a tile's SPLIT to take its ticket adds
    them in split order (deterministic), the residual, and stores the row."""
    t = tl.program_id(0).to(tl.int64)
    WG: tl.constexpr = GROUP // 8
    RW = ROW // 4
    tile = tl.program_id(1)
    rn = tile * BN + tl.arange(0, BN)
    n_ok = rn < H
    words = w_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros((BN,), dtype=tl.float32)
    sp = tl.program_id(2)
    for k in range(sp * (TOPK // SPLIT), (sp + 1) * (TOPK // SPLIT)):
        pair = t * TOPK + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        rows = words + (e * H + rn.to(tl.int64)) * RW
        scales = s_ptr + e * H * G + rn * G
        part = tl.zeros((BN,), dtype=tl.float32)
        for s in range(0, G // GPS):
            wd, sd = _load_words(rows, scales, s, n_ok, GPS, WG)
            d, sx = _words_step(wd, act_ptr + pair * I + s * GPS * GROUP, ONE, GPS, WG)
            part += tl.sum(sd * (128.0 * d - 136.0 * sx[None, :]), 1)
        acc += tl.load(tw_ptr + pair) * part
    if SPLIT > 1:
        part_at = part_ptr + t * H + rn
        tl.store(part_at + sp * M * H, acc, mask=n_ok)
        tl.debug_barrier()  # the whole part is written before the ticket is taken (release)
        ticket = ticket_ptr + t * tl.num_programs(1) + tile
        if tl.atomic_add(ticket, 1, sem="acq_rel") == SPLIT - 1:
            acc = _parts_sum(part_at, M * H, n_ok, SPLIT)
            if HAS_RES:
                acc += tl.load(res_ptr + t * H + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * H + rn, acc.to(tl.bfloat16), mask=n_ok)
            tl.atomic_xchg(ticket, 0)
    else:
        if HAS_RES:
            acc += tl.load(res_ptr + t * H + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + rn, acc.to(tl.bfloat16), mask=n_ok)


_TICKETS: dict = {}


def _tickets(n: int, device: torch.device, which: str) -> torch.Tensor:
    """Zeroed int32 counters kept between calls (each call leaves them at zero); grown, never shrunk."""
    have = _TICKETS.get((device, which))
    if have is None or have.numel() < n:
        have = _TICKETS[(device, which)] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return have


def config_for(m: int) -> dict:
    return dict(CONFIGS[min(CONFIGS, key=lambda k: (abs(k - m), k))])


def fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, config: dict | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' weighted sum [M, H] bf16 (plus `residual`, bf16 [M, H], where given: a layer's)."""
    cfg = config or config_for(x.shape[0])
    if cfg.get("PATH", "tc") == "cc":
        return _fused_moe_cc(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, cfg, residual)
    out = _fused_moe_tc(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, cfg)
    return out if residual is None else out + residual


def _dims(x, topk_ids, w13, w13_scale, w2) -> tuple[int, ...]:
    """M, H, E, topk, I, group, the pair count: read off the inputs' shapes."""
    M, H = x.shape
    topk = topk_ids.shape[1]
    return M, H, w13.shape[0], topk, w2.shape[-1] * 2, H // w13_scale.shape[-1], M * topk


def _launch(cfg: dict, which: str, cuda: bool) -> dict:
    """A kernel's warps and pipeline depth; with "maxnreg_up" / "maxnreg_down" set (0 or absent: the compiler's
    choice), a cap on a thread's registers: more programs an SM for a few spilled values. The tensor-core
    gate/up holds ~245 registers at BN 64 on 2 warps, so 4 programs an SM (ncu's 12.5% occupancy, the kernels
    latency-bound); capped at 192 / 168 / 128 it compiles with 72 / 104 / 272 bytes of stack for 5 / 6 / 8
    (benchmarks/static_kernels.py). Whether the occupancy buys more than the spills cost is the GPU's to say."""
    if not cuda:
        return {}
    launch = {"num_warps": int(cfg[f"warps_{which}"]), "num_stages": int(cfg[f"stages_{which}"])}
    if int(cfg.get(f"maxnreg_{which}", 0)):
        launch["maxnreg"] = int(cfg[f"maxnreg_{which}"])
    return launch


def _route_pairs(ids: torch.Tensor, n_pairs: int, E: int, bt: int, pdl: bool = False):
    """The pairs sorted by expert, cut into blocks of at most bt (see _route); the block count bound. `pdl`:
    _route lets the next kernel (launched with launch_pdl) start while it runs."""
    dev = ids.device
    max_blocks = min(E, n_pairs) + n_pairs // bt
    spair = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    sexp = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    bstart = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    bexp = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    if n_pairs <= MAX_PAIRS:
        _route[(1,)](ids, spair, sexp, bstart, bexp, nblk, n_pairs, NP=max(16, triton.next_power_of_2(n_pairs)),
                     BT=bt, PDL=pdl)
        return max_blocks, (spair, sexp, bstart, bexp, nblk)
    # many pairs: ranks by an atomic count per expert (their order inside an expert's run varies from call
    # to call; every pair's row is computed and summed alike wherever it sits, so the output does not)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    rank = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    estart = torch.empty(E, dtype=torch.int32, device=dev)
    bfirst = torch.empty(E, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(n_pairs, 1024),)
    _count[grid](ids, counts, rank, n_pairs, BLOCK=1024)
    _cut[(1,)](counts, estart, bfirst, bstart, bexp, nblk, E, max_blocks, EB=triton.next_power_of_2(E), BT=bt, CH=64)
    _scatter[grid](ids, rank, estart, spair, sexp, n_pairs, BLOCK=1024)
    return max_blocks, (spair, sexp, bstart, bexp, nblk)


def _fused_moe_cc(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, cfg: dict, residual=None):
    """The CUDA-core path: _gate_up_cc over blocks of one expert's pairs (BT = 1: every pair its own
    block, no sort), _down_cc over tokens. Two launches (three when sorted)."""
    M, H, E, topk, I, group, n_pairs = _dims(x, topk_ids, w13, w13_scale, w2)
    # groups a step: the tuned count where it divides the groups along K (the smoke model has fewer)
    bt, gps_up, gps_down = int(cfg["BT"]), gcd(int(cfg["GPS_UP"]), H // group), gcd(int(cfg["GPS_DOWN"]), I // group)
    cuda = x.device.type == "cuda"
    ids = topk_ids.reshape(-1).to(torch.int32)
    if bt > 1:
        blocks, route = _route_pairs(ids, n_pairs, E, bt)
    else:
        blocks, route = n_pairs, (ids,) * 5  # unused pointers
    act = torch.empty(n_pairs, I, dtype=torch.float32, device=x.device)
    bn_up, bn_down, prefetch = int(cfg["BN_UP"]), int(cfg["BN_DOWN"]), bool(cfg.get("PREFETCH", 0))
    out = torch.empty(M, H, dtype=torch.bfloat16, device=x.device)
    if cfg.get("UNPACK", "bytes") == "words":  # one pair a program row; 32-bit words, one fma a weight
        if bt != 1:
            raise ValueError(f"UNPACK words runs one pair a block (BT 1), not BT {bt}")
        split_up, split_down = int(cfg.get("SPLIT_UP", 1)), int(cfg.get("SPLIT_DOWN", 1))
        if (H // group // gps_up) % split_up or topk % split_down:
            raise ValueError(f"SPLIT_UP {split_up} must divide the {H // group // gps_up} steps along K and "
                             f"SPLIT_DOWN {split_down} the {topk} experts of a token")
        up_tiles, down_tiles = triton.cdiv(I, bn_up), triton.cdiv(H, bn_down)
        parts = torch.empty(split_up, n_pairs, 2 * I, dtype=torch.float32, device=x.device) if split_up > 1 else act
        _gate_up_words[(n_pairs, up_tiles, split_up)](
            x, w13, w13_scale, ids, act, parts, _tickets(n_pairs * up_tiles, x.device, "up"), n_pairs, H, I,
            H // group, H // 2, ONE, TOPK=topk, BN=bn_up, GROUP=group, GPS=gps_up, SPLIT=split_up,
            **_launch(cfg, "up", cuda))
        down_parts = torch.empty(split_down, M, H, dtype=torch.float32, device=x.device) if split_down > 1 else act
        _down_words[(M, down_tiles, split_down)](
            act, w2, w2_scale, topk_weights.reshape(-1).float(), ids, x if residual is None else residual, down_parts,
            _tickets(M * down_tiles, x.device, "down"), out, M, H, I, I // group, I // 2, ONE, TOPK=topk, BN=bn_down,
            GROUP=group, GPS=gps_down, HAS_RES=residual is not None, SPLIT=split_down, **_launch(cfg, "down", cuda))
        return out
    _gate_up_cc[(blocks, triton.cdiv(I, bn_up))](
        x, w13, w13_scale, *route, ids, act, n_pairs, H, I, H // group, H // 2, TOPK=topk, BT=bt, BN=bn_up, GROUP=group,
        GPS=gps_up, SORTED=bt > 1, PREFETCH=prefetch, **_launch(cfg, "up", cuda))
    _down_cc[(M, triton.cdiv(H, bn_down))](
        act, w2, w2_scale, topk_weights.reshape(-1).float(), ids, x if residual is None else residual, out, H, I,
        I // group, I // 2, TOPK=topk, BN=bn_down, GROUP=group, GPS=gps_down, HAS_RES=residual is not None,
        PREFETCH=prefetch, **_launch(cfg, "down", cuda))
    return out


def _fused_moe_tc(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, cfg: dict) -> torch.Tensor:
    M, H, E, topk, I, group, n_pairs = _dims(x, topk_ids, w13, w13_scale, w2)
    bt, bn_up, bn_down = int(cfg["BT"]), int(cfg["BN_UP"]), int(cfg["BN_DOWN"])
    split_up, split_down = int(cfg["SPLIT_UP"]), int(cfg["SPLIT_DOWN"])
    rows = bool(cfg.get("ROWS", 0))  # the tokens as the dot's first operand (the production orientation)
    post = bt <= 32  # each group's scale on the dots' sums, not on every weight (see _mac)
    for name, split, groups in (("SPLIT_UP", split_up, H // group), ("SPLIT_DOWN", split_down, I // group)):
        if groups % split:
            raise ValueError(f"{name} = {split} must divide the {groups} quantisation groups along K")
    f32 = x.device.type != "cuda"  # a CPU tensor runs only under Triton's interpreter
    up_launch, down_launch = _launch(cfg, "up", not f32), _launch(cfg, "down", not f32)
    # Hopper's programmatic dependent launch: _gate_up and _down launched while the kernel before them runs,
    # each waiting on the device (gdc_wait) for its end: the launches' gaps hidden
    pdl = bool(cfg.get("PDL", 0)) and not f32
    # SORT 0 (M1: each expert has one pair, so sorting groups nothing): no _route, block b is pair b; _gate_up
    # is then the call's first kernel, launched plainly (a call's first kernel never overlaps the previous call)
    ids = topk_ids.reshape(-1).to(torch.int32)
    sort = bool(cfg.get("SORT", 1))
    if pdl:
        up_launch = {**up_launch, "launch_pdl": True} if sort else up_launch
        down_launch = {**down_launch, "launch_pdl": True}
    dev = x.device
    if sort:
        max_blocks, route = _route_pairs(ids, n_pairs, E, bt, pdl)
    else:
        max_blocks, route = n_pairs, (ids,) * 5  # unsorted, _block reads the experts through sexp_ptr
    act = torch.empty(n_pairs, I, dtype=torch.bfloat16, device=dev)
    up_tiles = triton.cdiv(I, bn_up)
    parts = act if split_up == 1 else torch.empty(split_up, n_pairs, 2 * I, dtype=torch.float32, device=dev)
    _gate_up[(max_blocks, up_tiles, split_up)](
        x, w13, w13_scale, *route, act, parts, _tickets(max_blocks * up_tiles, dev, "up"), n_pairs, H, I,
        H // group, H // 2, TOPK=topk, BT=bt, BN=bn_up, GROUP=group, SPLIT=split_up, F32=f32, ROWS=rows, POST=post,
        PDL=pdl, SORTED=sort, **up_launch)
    down_tiles = triton.cdiv(H, bn_down)
    out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    pair_out = torch.empty(split_down, n_pairs, H, dtype=torch.float32, device=dev)
    _down[(max_blocks, down_tiles, split_down)](
        act, w2, w2_scale, topk_weights.reshape(-1).float(), *route, pair_out,
        _tickets(M * down_tiles, dev, "down"), out, n_pairs, H, I, I // group, I // 2, TOPK=topk, BT=bt, BN=bn_down,
        GROUP=group, SPLIT=split_down, F32=f32, ROWS=rows, POST=post, PDL=pdl, SORTED=sort, **down_launch)
    return out


def custom_kernel(inputs: dict, config: dict | None = None) -> torch.Tensor:
    return fused_moe(inputs["x"].contiguous(), inputs["topk_ids"].contiguous(), inputs["topk_weights"].contiguous(),
                     inputs["w13"], inputs["w13_scale"], inputs["w2"], inputs["w2_scale"], config)
