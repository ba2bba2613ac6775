// lora_config.h: every number that the kernels and their Python planner share, written once.
// metrale_cli/ops/sources.py reads this file and each .cu (`#define NAME <integer>` lines only,
// one per line), so keep each definition a plain decimal integer. A kernel's figures are named
// by its __launch_bounds__: <PREFIX>_MIN_CTAS and <PREFIX>_LOADS.
#pragma once

// Threads per CTA for every kernel (4 warps).
#define METRALE_THREADS 128
// BF16 elements per 16-byte load: dims, ranks and row strides are multiples of it.
#define METRALE_VECTOR 8
// The largest max_rank: BGMV expand keeps a token's t row (F32) in shared memory.
#define METRALE_MAX_RANK 256
// Split-K never cuts K into more partials than this (the expand sums them).
#define METRALE_MAX_SPLITS 32

// bgmv_shrink: rank rows per CTA, and K steps (of METRALE_THREADS x 8 elements) per pass. A pass
// issues BGMV_SHRINK_STEPS x (1 + BGMV_SHRINK_ROWS) 16-byte loads per thread before its first use.
#define BGMV_SHRINK_ROWS 4
#define BGMV_SHRINK_STEPS 2
// bgmv_expand: output rows per thread in the y epilogue (one 16-byte BF16 y vector; a CTA owns
// METRALE_THREADS x that rows), and B rows per thread per pass: a pass issues BGMV_EXPAND_STEPS
// 16-byte B loads per thread, one per row, before its first use.
#define BGMV_EXPAND_ROWS 8
#define BGMV_EXPAND_STEPS 16
// SGMV tiles: 64 tokens (4 warps x the mma's 16 rows) x 64 rank or output columns x 64 K.
#define SGMV_TILE 64
// SGMV pipeline stages: K tiles (shrink) and rank chunks (expand) in flight per CTA, streamed by
// cp.async into shared memory; each stage is a 64 x 64 x tile and A tile (16 KiB) or an F32
// t tile and a B tile (24 KiB), within the 48 KiB of static shared memory.
#define SGMV_SHRINK_STAGES 3
#define SGMV_EXPAND_STAGES 2
// Split-K's last sgmv_shrink CTA of a tile whose rank rows lie in its first 16 columns (rank 16,
// the decode case) reads this many splits' partials (8 values a thread each) before its first
// add: one L2 round trip per that many splits (costs.SPLIT_READS has what ptxas makes of it and
// of the splits left over, as tests/test_kernels_sass.py reads it from the machine code).
#define SGMV_SPLITS_PER_TRIP 4
// The same for any other tile (32 values a thread a split; on sm_90 ptxas issues 54 of the 64
// loads before the first add, so the pair takes 2 round trips there).
#define SGMV_WIDE_SPLITS_PER_TRIP 2

// Per kernel: the CTAs per SM its __launch_bounds__ guarantees (so ptxas keeps registers within
// 65536 / (METRALE_THREADS x that)), and the independent 16-byte global loads per thread that each
// of its hot loops issues before the first instruction that uses one of them (for the SGMV
// pipelines: the cp.async copies in flight at each wait, a stage's 8 or 12 copies times the 3 or
// 2 stages). The second number is what tests/test_kernels_sass.py checks in the sm_90 machine
// code and what the roofline model (metrale bench kernels --model-only) turns into bytes in
// flight; kernels/README.md explains them.
#define BGMV_SHRINK_MIN_CTAS 6
#define BGMV_SHRINK_LOADS 10
#define BGMV_EXPAND_MIN_CTAS 4
#define BGMV_EXPAND_LOADS 16
#define SGMV_SHRINK_MIN_CTAS 3
#define SGMV_SHRINK_LOADS 24
#define SGMV_EXPAND_MIN_CTAS 3
#define SGMV_EXPAND_LOADS 24

// expert.cu (kernels/README.md): pairs per tile of one (slot, expert) group on the decode and
// the grouped prefill path (each weight vector a CTA loads feeds that many pairs); the router's
// and the expand's rank vectors per pass; the overlay gather's 16-byte loads per pass.
#define EXPERT_DECODE_TILE 2
#define EXPERT_PREFILL_TILE 8
// expert_shrink_prefill (tensor cores): rank rows per CTA, 4 m16 tiles.
#define EXPERT_SHRINK_PREFILL_ROWS 64
#define EXPERT_EXPAND_COLS 2
#define ROUTER_COLS 4
#define OVERLAY_LOADS 4
// Loads in flight per thread, as ptxas schedules them (the SASS check holds them): the decode
// shrink issues 4 A + 2 x vectors a pass; the decode expand 8 rows x 2 columns of B, of which 10
// precede the first product; the prefill tiles run on mma: the shrink's pass is (1 x + 2 per
// m16 tile of A) vectors per 32-wide K chunk, 18 for 1 or 4 tiles (15 for 2, which ptxas issues
// two passes at a time: 30), the expand's 16 B vectors, double-buffered (the next pass's loads
// in flight during this one's mma; at rank 16 or below one pass of 8 or 16 holds the CTA's
// rows, no loop); router_lora_*: ROUTER_COLS B vectors a pass (its shrink loop issues 5).
#define EXPERT_SHRINK_DECODE_MIN_CTAS 4
#define EXPERT_SHRINK_DECODE_LOADS 6
#define EXPERT_SHRINK_PREFILL_MIN_CTAS 2
#define EXPERT_SHRINK_PREFILL_LOADS 18
#define EXPERT_EXPAND_DECODE_MIN_CTAS 4
#define EXPERT_EXPAND_DECODE_LOADS 10
#define EXPERT_EXPAND_PREFILL_MIN_CTAS 2
#define EXPERT_EXPAND_PREFILL_LOADS 16
#define ROUTER_LORA_MIN_CTAS 1
#define ROUTER_LORA_LOADS 4
#define OVERLAY_GATHER_MIN_CTAS 1
#define OVERLAY_GATHER_LOADS 4
