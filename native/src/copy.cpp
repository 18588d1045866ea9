// pdpush's native row copies (``_copy``), for the KV codec (pdpush/kvcodec.py): the engine's gather of
// token-major KV rows into head-major staging pages, at memory speed. No UCX: this module builds alone
// (``-C cmake.define.PDPUSH_DATAPLANE=OFF``) for an engine's venv that has no data plane.
//
// The rows are walked in the source's memory order (its outer axes sorted by stride), so the reads stream
// and the writes go to a few sequential places (a page per head): a token-major layer into head-major pages
// ran at memcpy speed out of cache this way, and at 0.65x in the destination's order (numpy's, the reads
// then stride over the whole layer once per head). Rows of the common sizes are copies of known size, built
// for the CPU's widest vectors (target_clones); kvcodec.stage's common case is one call per layer
// (stage_pages), since a dozen array views per component cost as much as the copy at 256 KiB layers.
//
// What goes into staging (stage_pages and gather_rows with ``stream``) is written with streaming (non-temporal)
// stores where the CPU has them: no line of staging is read into the cache to be written, and this core never
// reads staging again (the sender's put does, on another core). Staging is a ring the size of several requests,
// so its lines are out of this core's cache when it writes them: inside a push, a 256 KiB layer's copy took
// 59 us with cached stores and 43 us streamed, and the engine's whole put_layer 0.10 against 0.045 ms. A
// destination still in cache (a loop over one buffer) is slower streamed: set_streaming(false) for that.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nb = nanobind;

namespace {

constexpr size_t kMaxDims = 8;

using Dst = nb::ndarray<uint8_t, nb::device::cpu>;        // any strides (in bytes: the elements are bytes)
using Src = nb::ndarray<const uint8_t, nb::device::cpu>;  // read-only arrays too

// ``n`` rows of ``row`` bytes, ``ds``/``ss`` bytes apart. The common row sizes (a head of 16-bit elements x 64,
// 128 or 256, and fp32 x 128) are copies of known size, inlined as vector moves of the CPU's width: as fast as
// a libc memcpy call per row for 256-byte rows, and 0.86x instead of 0.72x memcpy's rate for 128-byte rows
// out of cache (measured here; inlined SSE2 alone was 20% slower than the libc call).
template <size_t R>
void copy_fixed(uint8_t *d, const uint8_t *s, size_t n, int64_t ds, int64_t ss) {
    for (; n; --n, d += ds, s += ss) std::memcpy(d, s, R);
}

#if defined(__SSE2__)
bool streaming = true;

// ``n`` bytes with streaming stores, 16 at a time (``d`` 16-byte aligned, ``n`` a multiple of 16). Weakly
// ordered: the copy's caller fences (``fence_streams``) before anything says the bytes are there.
template <size_t N>
inline void stream_fixed(uint8_t *d, const uint8_t *s) {
    static_assert(N % 16 == 0);
    for (size_t i = 0; i < N; i += 16)
        _mm_stream_si128(reinterpret_cast<__m128i *>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i)));
}

inline void stream_bytes(uint8_t *d, const uint8_t *s, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) stream_fixed<64>(d + i, s + i);
    for (; i < n; i += 16) stream_fixed<16>(d + i, s + i);
}

// Whole cache lines only: a line streamed in part is flushed slowly, and may share its line with cached stores.
inline bool stream_ok(const void *d, uint64_t n) { return (reinterpret_cast<uintptr_t>(d) | n) % 64 == 0; }

template <size_t R>
void stream_rows(uint8_t *d, const uint8_t *s, size_t n, int64_t ds, int64_t ss) {
    for (; n; --n, d += ds, s += ss) stream_fixed<R>(d, s);
}

inline void fence_streams(bool on) {
    if (on) _mm_sfence();  // the streamed bytes are visible before any later store (a ring record, a message)
}

// Fences when it goes out of scope, however the copy ends (a bad row's exception too): declared after the GIL's
// release, so before the interpreter has the thread back.
struct StreamFence {
    bool on;
    ~StreamFence() { fence_streams(on); }
};
#else
constexpr bool streaming = false;
inline void stream_bytes(uint8_t *, const uint8_t *, size_t) {}
inline bool stream_ok(const void *, uint64_t) { return false; }
inline void fence_streams(bool) {}
struct StreamFence {
    bool on;
};
#endif

// Whether a copy asked to stream does (where the CPU has SSE2): on by default; off for A/B measurements.
// Returns the previous setting.
bool set_streaming(bool on) {
#if defined(__SSE2__)
    const bool was = streaming;
    streaming = on;
    return was;
#else
    (void)on;
    return false;
#endif
}

#if defined(__x86_64__)
// Rows of whole cache lines streamed a line at a time, in two 32-byte or one 64-byte store: a 256-byte row is 8 or
// 4 store-queue entries instead of 16, so more of the strided source rows' misses are in flight at once (the
// source's rows are 2 KiB apart, two to a 4 KiB page: the prefetchers leave most of their lines to demand misses).
// On an AMD EPYC (Zen 4) the staging copy of 256 KiB to 16 MiB layers ran at 0.66-0.79x of glibc's memcpy with
// 16-byte stores, 0.80-1.09x with 32-byte ones and 0.82-1.04x with 64-byte ones (medians of paired runs, issue
// #36). 32 bytes is the default: no better than 64 measured, and no AVX-512 frequency drop on older Xeons. Since
// stage_pages walks streamed rows token by token (the source in its memory order), the width moves nothing
// measurable there (16, 32 and 64 bytes all 1.2-1.6x memcpy on the same host): the reason above held for the
// blocks it walked before, each head's rows of 16 tokens, 2 KiB apart.
__attribute__((target("avx2"))) void stream_rows32(uint8_t *d, const uint8_t *s, size_t n, int64_t ds, int64_t ss,
                                                   size_t row) {
    for (; n; --n, d += ds, s += ss)
        for (size_t i = 0; i < row; i += 64) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + i));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + i + 32));
            _mm256_stream_si256(reinterpret_cast<__m256i *>(d + i), a);
            _mm256_stream_si256(reinterpret_cast<__m256i *>(d + i + 32), b);
        }
}

__attribute__((target("avx512f"))) void stream_rows64(uint8_t *d, const uint8_t *s, size_t n, int64_t ds, int64_t ss,
                                                      size_t row) {
    for (; n; --n, d += ds, s += ss)
        for (size_t i = 0; i < row; i += 64)
            _mm512_stream_si512(reinterpret_cast<__m512i *>(d + i), _mm512_loadu_si512(s + i));
}

// The widest streaming store the CPU has: 64 (AVX-512), 32 (AVX2) or 16 bytes.
int widest_stream() { return __builtin_cpu_supports("avx512f") ? 64 : __builtin_cpu_supports("avx2") ? 32 : 16; }
int stream_width = std::min(32, widest_stream());  // stream_strided's

// Tests and A/B measurements take another (16, 32 or 64, capped at the CPU's); returns the previous.
int set_stream_width(int bytes) {
    const int was = stream_width;
    stream_width = std::min(bytes >= 64 ? 64 : bytes >= 32 ? 32 : 16, widest_stream());
    return was;
}
#else
int set_stream_width(int) { return 16; }
#endif

// ``copy_strided`` with streaming stores; false (nothing copied) where the rows or their places are not whole
// cache lines.
bool stream_strided(uint8_t *d, const uint8_t *s, size_t n, int64_t ds, int64_t ss, size_t row) {
    if (!stream_ok(d, static_cast<uint64_t>(ds) | row)) return false;
#if defined(__x86_64__)
    if (stream_width == 64) return stream_rows64(d, s, n, ds, ss, row), true;
    if (stream_width == 32) return stream_rows32(d, s, n, ds, ss, row), true;
#endif
#if defined(__SSE2__)
    switch (row) {
        case 128: stream_rows<128>(d, s, n, ds, ss); return true;
        case 256: stream_rows<256>(d, s, n, ds, ss); return true;
        case 512: stream_rows<512>(d, s, n, ds, ss); return true;
        default:
            for (; n; --n, d += ds, s += ss) stream_bytes(d, s, row);
            return true;
    }
#else
    (void)s, (void)n, (void)ss;
    return false;
#endif
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void copy_strided(uint8_t *d, const uint8_t *s, size_t n, int64_t ds, int64_t ss, size_t row) {
    switch (row) {
        case 128: return copy_fixed<128>(d, s, n, ds, ss);
        case 256: return copy_fixed<256>(d, s, n, ds, ss);
        case 512: return copy_fixed<512>(d, s, n, ds, ss);
        default:
            for (; n; --n, d += ds, s += ss) std::memcpy(d, s, row);
    }
}

// Copy every row of ``src`` into the same place of ``dst``: two byte arrays of one shape ``[..., row]``
// whose last axis is contiguous, any strides on the others. They must not overlap (the codec's never do:
// an engine's KV and staging).
void copy_rows(Dst dst, Src src) {
    const size_t nd = dst.ndim();
    if (nd != src.ndim() || nd == 0 || nd > kMaxDims)
        throw std::invalid_argument("copy_rows: arrays of " + std::to_string(dst.ndim()) + " and " +
                                    std::to_string(src.ndim()) + " dimensions (1 to 8, the same)");
    for (size_t i = 0; i < nd; ++i)
        if (dst.shape(i) != src.shape(i))
            throw std::invalid_argument("copy_rows: shapes differ at axis " + std::to_string(i));
    size_t order[kMaxDims];  // the outer axes by the source's stride, largest first: its memory order
    std::iota(order, order + nd - 1, size_t{0});
    std::stable_sort(order, order + nd - 1, [&](size_t a, size_t b) {
        return std::abs(src.stride(a)) > std::abs(src.stride(b));
    });
    order[nd - 1] = nd - 1;
    size_t shape[kMaxDims];
    int64_t ds[kMaxDims], ss[kMaxDims];
    for (size_t i = 0; i < nd; ++i) {
        shape[i] = dst.shape(order[i]);
        ds[i] = dst.stride(order[i]);
        ss[i] = src.stride(order[i]);
    }
    const size_t row = shape[nd - 1];
    if (row > 1 && (ds[nd - 1] != 1 || ss[nd - 1] != 1))
        throw std::invalid_argument("copy_rows: the last axis (a row's bytes) must be contiguous");
    for (size_t i = 0; i < nd; ++i)
        if (shape[i] == 0) return;
    uint8_t *d0 = dst.data();
    const uint8_t *s0 = src.data();
    nb::gil_scoped_release unlocked;
    if (nd == 1) {
        std::memcpy(d0, s0, row);
        return;
    }
    // an odometer over the outer axes; the innermost of them is the tight loop
    const size_t outer = nd - 1, inner = outer - 1;
    size_t idx[kMaxDims] = {};
    for (;;) {
        uint8_t *d = d0;
        const uint8_t *s = s0;
        for (size_t i = 0; i < inner; ++i) {
            d += static_cast<int64_t>(idx[i]) * ds[i];
            s += static_cast<int64_t>(idx[i]) * ss[i];
        }
        copy_strided(d, s, shape[inner], ds[inner], ss[inner], row);
        size_t i = inner;
        for (; i-- > 0;) {
            if (++idx[i] < shape[i]) break;
            idx[i] = 0;
        }
        if (i == static_cast<size_t>(-1)) return;
    }
}

using Comp = nb::ndarray<const uint8_t, nb::ndim<3>, nb::device::cpu>;  // [tokens, heads, row bytes]
using Flat = nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using Segs = nb::ndarray<const int64_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;

// One layer of a rank's share into staging, whole heads per unit (kvcodec.stage's common case), in one call:
// ``dst`` is the share's bytes ``[U, n, hu, C, T, rb]``; ``comps`` the C components ``[tokens, heads, rb]``
// (a row's bytes contiguous, any strides on the rest), of which heads ``[h0, h0 + U * hu)`` are written; each
// segment (j0, s0, m) puts source token rows ``[s0, s0 + m)`` into new pages j0, j0 + 1, ..., and the rows of a
// partial last page past ``m`` are zeroed. Streamed (staging's case), the rows are walked token by token, each
// head's row of a token to its page: the source is read in its memory order and every store is a whole line, so
// the H places written at once cost nothing (no line is read to be written). Cached, a place written in part
// pulls its line in, so the rows go in blocks (each head's run of a block is 4 KiB of its page, the writes to
// one place at a time). On an AMD EPYC (Zen 4), 256 KiB to 16 MiB layers against a memcpy into the same ring
// (medians of paired runs, issue #36): streamed in blocks 0.82-0.89x (the source's strided rows leave most of
// their lines to demand misses), streamed token by token 1.18-1.54x, at any store width. Cached, token by token
// the 1 MiB layers' copy ran at 0.59x in a loop over one buffer (2026-12-05), in blocks 0.79x. One Python call
// per layer instead of a dozen array views per component.
// Every shape and index is checked before any byte moves.
bool stage_pages(Flat dst, std::vector<Comp> comps, size_t h0, size_t units, size_t hu, size_t T, Segs segs,
                 bool stream) {
    const size_t C = comps.size();
    if (C == 0 || T == 0 || units == 0 || hu == 0) throw std::invalid_argument("stage_pages: nothing to write into");
    const size_t tokens = comps[0].shape(0), heads = comps[0].shape(1), rb = comps[0].shape(2);
    if (rb == 0) throw std::invalid_argument("stage_pages: rows of no bytes");
    for (const Comp &c : comps) {
        if (c.shape(0) != tokens || c.shape(1) != heads || c.shape(2) != rb)
            throw std::invalid_argument("stage_pages: components of different shapes");
        if (rb > 1 && c.stride(2) != 1) throw std::invalid_argument("stage_pages: a row's bytes must be contiguous");
    }
    const size_t H = units * hu;
    if (h0 > heads || H > heads - h0)
        throw std::invalid_argument("stage_pages: heads " + std::to_string(h0) + ".." + std::to_string(h0 + H) +
                                    " of " + std::to_string(heads));
    size_t page, pages_unit;  // one unit of one page; all units of one page (checked: a wrap would pass the checks)
    if (__builtin_mul_overflow(hu, C, &page) || __builtin_mul_overflow(page, T, &page) ||
        __builtin_mul_overflow(page, rb, &page) || __builtin_mul_overflow(units, page, &pages_unit))
        throw std::invalid_argument("stage_pages: a page size past 2**64 bytes");
    if (dst.shape(0) % pages_unit) throw std::invalid_argument("stage_pages: the share is not whole pages");
    const size_t n = dst.shape(0) / pages_unit;
    const size_t S = segs.shape(0);
    if (S && segs.shape(1) != 3) throw std::invalid_argument("stage_pages: segments are (j0, s0, m)");
    const int64_t *sg = segs.data();
    for (size_t k = 0; k < S; ++k) {
        const int64_t j0 = sg[3 * k], s0 = sg[3 * k + 1], m = sg[3 * k + 2];
        if (j0 < 0 || s0 < 0 || m < 0 || static_cast<uint64_t>(s0) > tokens ||
            static_cast<uint64_t>(m) > tokens - static_cast<uint64_t>(s0) || static_cast<uint64_t>(j0) > n ||
            static_cast<uint64_t>(m) / T + (static_cast<uint64_t>(m) % T != 0) > n - static_cast<uint64_t>(j0))
            throw std::out_of_range("stage_pages: segment " + std::to_string(k) + " reaches outside the source or the share");
    }
    std::vector<const uint8_t *> base(C);
    std::vector<int64_t> ts(C), hs(C);
    for (size_t c = 0; c < C; ++c) base[c] = comps[c].data(), ts[c] = comps[c].stride(0), hs[c] = comps[c].stride(1);
    uint8_t *d0 = dst.data();
    const int64_t unit_stride = static_cast<int64_t>(n * page), head_stride = static_cast<int64_t>(C * T * rb);
    const size_t block = std::max<size_t>(1, 4096 / rb);  // token rows a head's run covers: 4 KiB of its page
    const bool nt = stream && streaming;
    const bool by_token = nt && stream_ok(d0, rb);  // whole lines: every row of every head's page streams
    std::vector<uint8_t *> dh(H);
    bool streamed = false;
    nb::gil_scoped_release unlocked;
    const StreamFence fence{nt};
    for (size_t c = 0; c < C; ++c) {
        for (size_t k = 0; k < S; ++k) {
            const size_t j0 = sg[3 * k], s0 = sg[3 * k + 1], m = sg[3 * k + 2];
            // token rows [r0, r1) of the segment (page j0 + r0 / T, rows r0 % T on): streamed, token by token
            // (each head's row of a token to its page); cached, each head's run of a block of them
            for (size_t r0 = 0; r0 < m;) {
                const size_t r1 = std::min({m, by_token ? m : r0 + block, (r0 / T + 1) * T});
                const uint8_t *s = base[c] + static_cast<int64_t>(s0 + r0) * ts[c] + static_cast<int64_t>(h0) * hs[c];
                uint8_t *d = d0 + ((j0 + r0 / T) * hu * C + c) * T * rb + (r0 % T) * rb;
                for (size_t h = 0; h < H; ++h)
                    dh[h] = d + static_cast<int64_t>(h / hu) * unit_stride + static_cast<int64_t>(h % hu) * head_stride;
                if (by_token) {
                    for (size_t i = 0; i < r1 - r0; ++i, s += ts[c])
                        for (size_t h = 0; h < H; ++h)
                            if (stream_strided(dh[h] + i * rb, s + static_cast<int64_t>(h) * hs[c], 1, 0, 0, rb))
                                streamed = true;
                            else  // (not reached: by_token holds every place whole lines)
                                copy_strided(dh[h] + i * rb, s + static_cast<int64_t>(h) * hs[c], 1, 0, 0, rb);
                } else {
                    for (size_t h = 0; h < H; ++h)
                        copy_strided(dh[h], s + static_cast<int64_t>(h) * hs[c], r1 - r0, static_cast<int64_t>(rb), ts[c], rb);
                }
                r0 = r1;
            }
            if (const size_t rest = m % T) {  // the partial last page's tail rows: zeroed
                for (size_t u = 0; u < units; ++u)
                    for (size_t i = 0; i < hu; ++i)
                        std::memset(d0 + u * n * page + ((j0 + m / T) * hu + i) * C * T * rb + (c * T + rest) * rb, 0,
                                    (T - rest) * rb);
            }
        }
    }
    return streamed;
}

template <typename E>
void gather_elems(uint8_t *d, const uint8_t *s, const int32_t *offs, size_t n) {
    E *out = reinterpret_cast<E *>(d);
    for (size_t i = 0; i < n; ++i) std::memcpy(out + i, s + static_cast<int64_t>(offs[i]) * sizeof(E), sizeof(E));
}

using Rows = nb::ndarray<uint8_t, nb::ndim<2>, nb::device::cpu>;
using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using Bases = nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using Sels = nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using Map = nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;

// Gather rows from an engine's own memory (a paged KV cache) in one pass: destination row ``r`` (``dst``
// [R, D * B], any row stride) is the ``D`` elements of ``B`` bytes at ``src[base[r] + emap[sel[r], d] * B]``
// for d < D (``base`` in bytes; a negative base zeroes the row). A map row of consecutive offsets is one
// memcpy; rows of a dimension-major K tile go G tokens at a time through an SSE2 transpose (by_tiles; a
// 16-row transpose written plainly measured slower: its strided stores do not vectorise); any other map
// element by element.
// ``dst_rows`` (optional): entry ``r`` of the table fills destination row ``dst_rows[r]`` instead of row ``r``,
// so that a table sorted by its source addresses (``kvcodec.source_order``) reads the engine's cache in its
// memory order: each block's heads' tiles one after the other, instead of staging's order (a head's tiles of
// every block, then the next head's), which jumps between blocks every 8 KiB. On an AMD EPYC, vLLM CPU_ATTN's
// blocks of 32 slots, 8 heads x 128 bf16, 1 to 16 MiB layers into a staging ring: 0.41-0.50x memcpy in staging's
// order, 0.48-0.62x in the cache's (paired with a memcpy; 1.14-1.27x the GB/s, more the larger the layer). It
// must be a permutation of [0, R): a row written twice and another never would leave a staging row's old bytes,
// another request's, in the push.
// Every address is checked against ``src``: a bad table raises, it never reads outside.
// An element map's rows, read once: each row's lowest and highest offset, and whether its offsets are
// consecutive (the row is then one memcpy).
struct MapRows {
    std::vector<int64_t> lo, hi;
    std::vector<char> run, shift1;  // shift1[m]: map row m + 1 is map row m, one element on (a transposed tile)
    size_t M, D;

    MapRows(const Map &emap, size_t eb, size_t rb, const char *who) : M(emap.shape(0)), D(emap.shape(1)) {
        if (eb != 1 && eb != 2 && eb != 4 && eb != 8) throw std::invalid_argument(std::string(who) + ": elements of 1, 2, 4 or 8 bytes");
        if (rb != D * eb) throw std::invalid_argument(std::string(who) + ": rows of " + std::to_string(rb) + " bytes, the map's are " +
                                                      std::to_string(D * eb));
        if (D == 0) throw std::invalid_argument(std::string(who) + ": a map of rows of no elements");
        lo.resize(M), hi.resize(M), run.resize(M);
        const int32_t *map = emap.data();
        for (size_t m = 0; m < M; ++m) {
            const int32_t *o = map + m * D;
            int64_t a = o[0], b = o[0];
            bool c = true;
            for (size_t d = 0; d < D; ++d) {
                a = std::min<int64_t>(a, o[d]);
                b = std::max<int64_t>(b, o[d]);
                c = c && o[d] == o[0] + static_cast<int64_t>(d);
            }
            lo[m] = a, hi[m] = b, run[m] = c;
        }
        shift1.assign(M, 0);
        for (size_t m = 0; m + 1 < M; ++m) {
            const int32_t *o = map + m * D;
            bool t = true;
            for (size_t d = 0; d < D && t; ++d) t = static_cast<int64_t>(o[D + d]) == static_cast<int64_t>(o[d]) + 1;
            shift1[m] = t;
        }
    }

    // Map rows m .. m + G - 1 are one map row shifted by 0 .. G - 1 elements, and not runs: G rows of a
    // dimension-major tile (each of its elements is G consecutive ones in memory, one per row).
    bool tile(int32_t m, size_t G) const {
        if (m < 0 || static_cast<size_t>(m) + G > M || run[m]) return false;
        for (size_t i = 0; i + 1 < G; ++i)
            if (!shift1[m + i]) return false;
        return true;
    }

    // Row ``m`` of the map from byte ``b`` stays inside [0, S). b <= S first: then b + an offset of the map
    // (|offset| < 2^31 elements of at most 8 bytes) cannot overflow.
    bool inside(int32_t m, int64_t b, int64_t S, size_t eb) const {
        return m >= 0 && static_cast<size_t>(m) < M && b <= S && b + lo[m] * static_cast<int64_t>(eb) >= 0 &&
               b + (hi[m] + 1) * static_cast<int64_t>(eb) <= S;
    }
};

// Dimension-major tiles (CPU_ATTN's K: element d of token n at d * N + n) as SSE2 transposes: G tokens of a
// row at once (8 of 16 bits, 4 of 32), one 16-byte load per element index and one 16-byte store per token
// instead of an element-sized load and store each (that path ran at 0.27x memcpy). Other element sizes, and
// CPUs without SSE2, keep the element path (tile_rows 0).
#if defined(__SSE2__)
constexpr size_t tile_rows(size_t eb) { return eb == 2 ? 8 : eb == 4 ? 4 : 0; }

template <size_t E>
inline void transpose(__m128i *r) {  // r[j] element i -> r[i] element j
    if constexpr (E == 2) {
        const __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
        const __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
        const __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
        const __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
        const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
        const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
        const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
        const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
        r[0] = _mm_unpacklo_epi64(b0, b4), r[1] = _mm_unpackhi_epi64(b0, b4);
        r[2] = _mm_unpacklo_epi64(b1, b5), r[3] = _mm_unpackhi_epi64(b1, b5);
        r[4] = _mm_unpacklo_epi64(b2, b6), r[5] = _mm_unpackhi_epi64(b2, b6);
        r[6] = _mm_unpacklo_epi64(b3, b7), r[7] = _mm_unpackhi_epi64(b3, b7);
    } else {
        const __m128i a0 = _mm_unpacklo_epi32(r[0], r[1]), a1 = _mm_unpackhi_epi32(r[0], r[1]);
        const __m128i a2 = _mm_unpacklo_epi32(r[2], r[3]), a3 = _mm_unpackhi_epi32(r[2], r[3]);
        r[0] = _mm_unpacklo_epi64(a0, a2), r[1] = _mm_unpackhi_epi64(a0, a2);
        r[2] = _mm_unpacklo_epi64(a1, a3), r[3] = _mm_unpackhi_epi64(a1, a3);
    }
}

// Rows i < G of a tile: row i's element k is at s + (o[k] + i) * E; row i goes to d[i] (D elements).
// With AVX2 (wide_tiles), 2G elements a pass: the same unpacks transpose two G x G blocks, one per 128-bit lane
// (elements k.. in the low lane, k + G.. in the high), so each token's 2G elements go in one 32-byte store. The
// hot tile was bound by the SSE2 transpose's instructions (10 GB/s against V's memcpys at 22). It is transpose's
// twin on purpose: one template for both widths would need the avx2 target on the SSE2 instance too, and
// that code would then fault on CPUs without AVX2.
#if defined(__x86_64__)
template <size_t E>
__attribute__((target("avx2"))) inline void transpose2(__m256i *r) {  // per lane: r[j] element i -> r[i] element j
    if constexpr (E == 2) {
        const __m256i a0 = _mm256_unpacklo_epi16(r[0], r[1]), a1 = _mm256_unpackhi_epi16(r[0], r[1]);
        const __m256i a2 = _mm256_unpacklo_epi16(r[2], r[3]), a3 = _mm256_unpackhi_epi16(r[2], r[3]);
        const __m256i a4 = _mm256_unpacklo_epi16(r[4], r[5]), a5 = _mm256_unpackhi_epi16(r[4], r[5]);
        const __m256i a6 = _mm256_unpacklo_epi16(r[6], r[7]), a7 = _mm256_unpackhi_epi16(r[6], r[7]);
        const __m256i b0 = _mm256_unpacklo_epi32(a0, a2), b1 = _mm256_unpackhi_epi32(a0, a2);
        const __m256i b2 = _mm256_unpacklo_epi32(a1, a3), b3 = _mm256_unpackhi_epi32(a1, a3);
        const __m256i b4 = _mm256_unpacklo_epi32(a4, a6), b5 = _mm256_unpackhi_epi32(a4, a6);
        const __m256i b6 = _mm256_unpacklo_epi32(a5, a7), b7 = _mm256_unpackhi_epi32(a5, a7);
        r[0] = _mm256_unpacklo_epi64(b0, b4), r[1] = _mm256_unpackhi_epi64(b0, b4);
        r[2] = _mm256_unpacklo_epi64(b1, b5), r[3] = _mm256_unpackhi_epi64(b1, b5);
        r[4] = _mm256_unpacklo_epi64(b2, b6), r[5] = _mm256_unpackhi_epi64(b2, b6);
        r[6] = _mm256_unpacklo_epi64(b3, b7), r[7] = _mm256_unpackhi_epi64(b3, b7);
    } else {
        const __m256i a0 = _mm256_unpacklo_epi32(r[0], r[1]), a1 = _mm256_unpackhi_epi32(r[0], r[1]);
        const __m256i a2 = _mm256_unpacklo_epi32(r[2], r[3]), a3 = _mm256_unpackhi_epi32(r[2], r[3]);
        r[0] = _mm256_unpacklo_epi64(a0, a2), r[1] = _mm256_unpackhi_epi64(a0, a2);
        r[2] = _mm256_unpacklo_epi64(a1, a3), r[3] = _mm256_unpackhi_epi64(a1, a3);
    }
}

// gather_tile's first passes, 2G elements each; returns the elements done. NT: streaming stores (rows 32-byte
// aligned).
template <size_t E, bool NT>
__attribute__((target("avx2"))) size_t gather_tile2(uint8_t *const *d, const uint8_t *s, const int32_t *o, size_t D) {
    constexpr size_t G = 16 / E;
    __m256i r[G];
    size_t k = 0;
    for (; k + 2 * G <= D; k += 2 * G) {
        for (size_t j = 0; j < G; ++j)
            r[j] = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + static_cast<int64_t>(o[k + j]) * E))),
                _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + static_cast<int64_t>(o[k + G + j]) * E)), 1);
        transpose2<E>(r);
        for (size_t i = 0; i < G; ++i) {
            if constexpr (NT)
                _mm256_stream_si256(reinterpret_cast<__m256i *>(d[i] + k * E), r[i]);
            else
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(d[i] + k * E), r[i]);
        }
    }
    return k;
}

// scatter_tile's first passes, 2G elements each; returns the elements done
template <size_t E>
__attribute__((target("avx2"))) size_t scatter_tile2(uint8_t *d, const int32_t *o, const uint8_t *const *s, size_t D) {
    constexpr size_t G = 16 / E;
    __m256i r[G];
    size_t k = 0;
    for (; k + 2 * G <= D; k += 2 * G) {
        for (size_t i = 0; i < G; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s[i] + k * E));
        transpose2<E>(r);
        for (size_t j = 0; j < G; ++j) {
            _mm_storeu_si128(reinterpret_cast<__m128i *>(d + static_cast<int64_t>(o[k + j]) * E), _mm256_castsi256_si128(r[j]));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(d + static_cast<int64_t>(o[k + G + j]) * E),
                             _mm256_extracti128_si256(r[j], 1));
        }
    }
    return k;
}

bool wide_tiles = __builtin_cpu_supports("avx2");

// Tests take either path: on (where the CPU has AVX2) or off; returns whether it was on.
bool set_wide_tiles(bool on) {
    const bool was = wide_tiles;
    wide_tiles = on && __builtin_cpu_supports("avx2");
    return was;
}
#else
constexpr bool wide_tiles = false;
bool set_wide_tiles(bool) { return false; }
template <size_t E, bool NT>
size_t gather_tile2(uint8_t *const *, const uint8_t *, const int32_t *, size_t) { return 0; }
template <size_t E>
size_t scatter_tile2(uint8_t *, const int32_t *, const uint8_t *const *, size_t) { return 0; }
#endif

// NT: streaming stores (rows 32-byte aligned).
template <size_t E, bool NT>
void gather_tile(uint8_t *const *d, const uint8_t *s, const int32_t *o, size_t D) {
    constexpr size_t G = 16 / E;
    __m128i r[G];
    size_t k = wide_tiles ? gather_tile2<E, NT>(d, s, o, D) : 0;
    for (; k + G <= D; k += G) {
        for (size_t j = 0; j < G; ++j) r[j] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + static_cast<int64_t>(o[k + j]) * E));
        transpose<E>(r);
        for (size_t i = 0; i < G; ++i) {
            if constexpr (NT)
                _mm_stream_si128(reinterpret_cast<__m128i *>(d[i] + k * E), r[i]);
            else
                _mm_storeu_si128(reinterpret_cast<__m128i *>(d[i] + k * E), r[i]);
        }
    }
    for (; k < D; ++k)
        for (size_t i = 0; i < G; ++i) std::memcpy(d[i] + k * E, s + (static_cast<int64_t>(o[k]) + static_cast<int64_t>(i)) * E, E);
}

// The way back: row i (D elements at s[i]) goes to element k of row i at d + (o[k] + i) * E.
template <size_t E>
void scatter_tile(uint8_t *d, const int32_t *o, const uint8_t *const *s, size_t D) {
    constexpr size_t G = 16 / E;
    __m128i r[G];
    size_t k = wide_tiles ? scatter_tile2<E>(d, o, s, D) : 0;
    for (; k + G <= D; k += G) {
        for (size_t i = 0; i < G; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s[i] + k * E));
        transpose<E>(r);
        for (size_t j = 0; j < G; ++j) _mm_storeu_si128(reinterpret_cast<__m128i *>(d + static_cast<int64_t>(o[k + j]) * E), r[j]);
    }
    for (; k < D; ++k)
        for (size_t i = 0; i < G; ++i) std::memcpy(d + (static_cast<int64_t>(o[k]) + static_cast<int64_t>(i)) * E, s[i] + k * E, E);
}
#else
constexpr size_t tile_rows(size_t) { return 0; }
#endif

// How far apart a table's rows of consecutive tokens of one tile are: the first row, among the first few that
// are read from somewhere (a zeroed row's base is negative), whose next token (same base, next map row) follows
// within 256 rows gives it (1 in a table sorted by its source, kvcodec.source_order's and scatter_order's, and
// in staging's order; heads x components in a token-major one); 0: none (no tiles).
size_t tile_step(const int64_t *bs, const int32_t *sl, size_t R) {
    for (size_t a = 0, looked = 0; a < R && looked < 8; ++a) {
        if (bs[a] < 0) continue;
        ++looked;
        for (size_t k = 1; a + k < std::min<size_t>(R, a + 257); ++k)
            if (bs[a + k] == bs[a] && static_cast<int64_t>(sl[a + k]) == static_cast<int64_t>(sl[a]) + 1) return k;
    }
    return 0;
}

// Whether rows r + i * q (i < G) are one tile: one base, map rows m + i of a transposed tile.
bool is_tile(const MapRows &mr, const int64_t *bs, const int32_t *sl, size_t r, size_t q, size_t G) {
    const int64_t b = bs[r];
    const int32_t m = sl[r];
    if (b < 0 || !mr.tile(m, G)) return false;
    for (size_t i = 1; i < G; ++i)
        if (bs[r + i * q] != b || static_cast<int64_t>(sl[r + i * q]) != static_cast<int64_t>(m) + static_cast<int64_t>(i)) return false;
    return true;
}

// Visit rows [0, R) as tiles where they form them (``tile(r, q)``: rows r + i * q), else one by one (``row(r)``):
// blocks of G * q rows, each q tiles of G, then the rows left. Consecutive rows (q = 1, a sorted table) are
// tried from every row a tile missed at, so a run of tiles that starts mid-block (a push from a block's middle,
// zeroed or V rows before it) is found whatever its offset.
template <typename Tile, typename Row>
void by_tiles(size_t R, size_t G, size_t q, Tile tile, Row row) {
    size_t r0 = 0;
    if (G && q == 1) {
        while (r0 + G <= R) {
            if (tile(r0, 1))
                r0 += G;
            else
                row(r0++);
        }
    } else if (G && q) {
        for (; r0 + G * q <= R; r0 += G * q)
            for (size_t j = 0; j < q; ++j)
                if (!tile(r0 + j, q))
                    for (size_t i = 0; i < G; ++i) row(r0 + j + i * q);
    }
    for (; r0 < R; ++r0) row(r0);
}

bool gather_rows(Rows dst, Bytes src, Bases base, Sels sel, Map emap, size_t eb, bool stream,
                 std::optional<Bases> dst_rows) {
    const size_t R = dst.shape(0), rb = dst.shape(1);
    const MapRows mr(emap, eb, rb, "gather_rows");
    const size_t D = mr.D;
    if (rb > 1 && dst.stride(1) != 1) throw std::invalid_argument("gather_rows: a row's bytes must be contiguous");
    if (base.shape(0) != R || sel.shape(0) != R)
        throw std::invalid_argument("gather_rows: base and sel need one entry per row");
    const int64_t *dr = nullptr;  // entry r's destination row: dr[r], else r
    if (dst_rows) {
        if (dst_rows->shape(0) != R) throw std::invalid_argument("gather_rows: dst_rows needs one entry per row");
        dr = dst_rows->data();
        std::vector<char> seen(R, 0);
        for (size_t r = 0; r < R; ++r) {
            if (dr[r] < 0 || static_cast<uint64_t>(dr[r]) >= R || seen[dr[r]])
                throw std::invalid_argument("gather_rows: dst_rows is not a permutation of the rows (entry " +
                                            std::to_string(r) + ")");
            seen[dr[r]] = 1;
        }
    }
    const int32_t *map = emap.data();
    const int64_t S = static_cast<int64_t>(src.shape(0));
    const int64_t *bs = base.data();
    const int32_t *sl = sel.data();
    const uint8_t *s0 = src.data();
    uint8_t *d0 = dst.data();
    const int64_t dstride = dst.stride(0);
    const bool nt = stream && streaming;
    bool streamed = false;
    nb::gil_scoped_release unlocked;
    const StreamFence fence{nt};
    auto checked = [&](size_t r) {
        if (!mr.inside(sl[r], bs[r], S, eb))
            throw std::out_of_range("gather_rows: row " + std::to_string(r) + " reaches outside the source");
    };
    auto place = [&](size_t r) { return d0 + (dr ? dr[r] : static_cast<int64_t>(r)) * dstride; };
    auto row = [&](size_t r) {
        uint8_t *d = place(r);
        const int64_t b = bs[r];
        if (b < 0) {
            std::memset(d, 0, rb);
            return;
        }
        checked(r);
        const int32_t m = sl[r];
        const uint8_t *s = s0 + b;
        const int32_t *o = map + static_cast<size_t>(m) * D;
        if (mr.run[m]) {
            const uint8_t *from = s + static_cast<int64_t>(o[0]) * static_cast<int64_t>(eb);
            if (nt && stream_ok(d, rb))
                stream_bytes(d, from, rb), streamed = true;
            else
                std::memcpy(d, from, rb);
            return;
        }
        switch (eb) {
            case 1: gather_elems<uint8_t>(d, s, o, D); break;
            case 2: gather_elems<uint16_t>(d, s, o, D); break;
            case 4: gather_elems<uint32_t>(d, s, o, D); break;
            default: gather_elems<uint64_t>(d, s, o, D); break;
        }
    };
    const size_t G = tile_rows(eb);
    auto tile = [&](size_t r, size_t q) {
#if defined(__SSE2__)
        if (!is_tile(mr, bs, sl, r, q, G)) return false;
        uint8_t *d[8];
        uintptr_t at = rb;  // the rows' places and length or'ed: streamed where all are whole cache lines
        for (size_t i = 0; i < G; ++i)
            checked(r + i * q), d[i] = place(r + i * q), at |= reinterpret_cast<uintptr_t>(d[i]);
        const uint8_t *s = s0 + bs[r];
        const int32_t *o = map + static_cast<size_t>(sl[r]) * D;
        if (nt && at % 64 == 0) {
            eb == 2 ? gather_tile<2, true>(d, s, o, D) : gather_tile<4, true>(d, s, o, D);
            streamed = true;
        } else {
            eb == 2 ? gather_tile<2, false>(d, s, o, D) : gather_tile<4, false>(d, s, o, D);
        }
        return true;
#else
        (void)r, (void)q;
        return false;
#endif
    };
    by_tiles(R, G, G ? tile_step(bs, sl, R) : 0, tile, row);
    return streamed;
}

template <typename E>
void scatter_elems(uint8_t *d, const uint8_t *s, const int32_t *offs, size_t n) {
    const E *in = reinterpret_cast<const E *>(s);
    for (size_t i = 0; i < n; ++i) std::memcpy(d + static_cast<int64_t>(offs[i]) * sizeof(E), in + i, sizeof(E));
}

// The way back, in one pass: row ``r`` of ``src`` (flat bytes; the row at byte ``src_off[r]``, ``D * B``
// bytes) goes to the ``D`` elements at ``dst[base[r] + emap[sel[r], d] * B]`` (a negative base: the row goes
// nowhere). The decode side's copy from the pool into an engine's paged cache. Every address is checked
// against ``src`` and ``dst`` before anything is written. Rows must not write the same bytes: tiles are
// written G rows at a time, not in the table's order (so where two rows did, the table's last would not win).
void scatter_rows(Flat dst, Bases base, Sels sel, Map emap, size_t eb, Bytes src, Bases src_off) {
    const size_t R = base.shape(0);
    const MapRows mr(emap, eb, emap.shape(1) * eb, "scatter_rows");
    const size_t D = mr.D, rb = D * eb;
    if (sel.shape(0) != R || src_off.shape(0) != R)
        throw std::invalid_argument("scatter_rows: base, sel and src_off need one entry per row");
    const int32_t *map = emap.data();
    const int64_t S = static_cast<int64_t>(dst.shape(0)), N = static_cast<int64_t>(src.shape(0));
    const int64_t *bs = base.data(), *so = src_off.data();
    const int32_t *sl = sel.data();
    for (size_t r = 0; r < R; ++r) {
        if (bs[r] < 0) continue;
        if (!mr.inside(sl[r], bs[r], S, eb))
            throw std::out_of_range("scatter_rows: row " + std::to_string(r) + " reaches outside the destination");
        if (so[r] < 0 || so[r] > N - static_cast<int64_t>(rb))
            throw std::out_of_range("scatter_rows: row " + std::to_string(r) + " reaches outside the source");
    }
    const uint8_t *s0 = src.data();
    uint8_t *d0 = dst.data();
    nb::gil_scoped_release unlocked;
    auto row = [&](size_t r) {
        if (bs[r] < 0) return;
        const int32_t m = sl[r];
        uint8_t *d = d0 + bs[r];
        const uint8_t *s = s0 + so[r];
        const int32_t *o = map + static_cast<size_t>(m) * D;
        if (mr.run[m]) {
            std::memcpy(d + static_cast<int64_t>(o[0]) * static_cast<int64_t>(eb), s, rb);
            return;
        }
        switch (eb) {
            case 1: scatter_elems<uint8_t>(d, s, o, D); break;
            case 2: scatter_elems<uint16_t>(d, s, o, D); break;
            case 4: scatter_elems<uint32_t>(d, s, o, D); break;
            default: scatter_elems<uint64_t>(d, s, o, D); break;
        }
    };
    const size_t G = tile_rows(eb);
    auto tile = [&](size_t r, size_t q) {  // (every row was checked above)
#if defined(__SSE2__)
        if (!is_tile(mr, bs, sl, r, q, G)) return false;
        const uint8_t *s[8];
        for (size_t i = 0; i < G; ++i) s[i] = s0 + so[r + i * q];
        const int32_t *o = map + static_cast<size_t>(sl[r]) * D;
        eb == 2 ? scatter_tile<2>(d0 + bs[r], o, s, D) : scatter_tile<4>(d0 + bs[r], o, s, D);
        return true;
#else
        (void)r, (void)q;
        return false;
#endif
    };
    by_tiles(R, G, G ? tile_step(bs, sl, R) : 0, tile, row);
}

}  // namespace

// The engine's side of a hand-over ring (pdpush/ring.py), for engines that have this module (else ring.py goes
// through libatomic with ctypes, ~1.5 us a call where this is ~0.2): ``records`` into the ring's slots from
// ``head`` on, each with a compare-and-swap of a free slot (0) to the record, a full barrier, so the staged
// bytes are visible before it; stops at the first slot the sender has not taken. How many were stored.
size_t ring_push(uintptr_t address, size_t slots, uint64_t head, const std::vector<uint64_t> &records) {
    if (address % 8 || slots == 0) throw std::invalid_argument("ring_push: a ring of aligned words, at least one");
    auto *ring = reinterpret_cast<uint64_t *>(address);
    size_t n = 0;
    for (uint64_t rec : records) {
        uint64_t expected = 0;
        if (!__atomic_compare_exchange_n(ring + (head + n) % slots, &expected, rec, false, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
            break;  // that slot still holds a record the sender has not taken: the ring is full
        ++n;
    }
    return n;
}

// A sequentially consistent load of an aligned word (the sender's idle word, after a ring_push).
uint64_t load_word(uintptr_t address) {
    if (address % 8) throw std::invalid_argument("load_word: an unaligned word");
    return __atomic_load_n(reinterpret_cast<const uint64_t *>(address), __ATOMIC_SEQ_CST);
}

NB_MODULE(_copy, m) {
    m.doc() = "pdpush's native row copies for the KV codec (no UCX)";
    m.def("ring_push", &ring_push, nb::arg("address"), nb::arg("slots"), nb::arg("head"), nb::arg("records"),
          "Store records into a hand-over ring's free slots from head on (compare-and-swap each); how many.");
    m.def("load_word", &load_word, nb::arg("address"), "A sequentially consistent load of an aligned u64.");
    m.def("set_streaming", &set_streaming, nb::arg("on"),
          "Whether stage_pages and gather_rows asked to stream do (the default, where the CPU has SSE2); returns "
          "the previous setting. For A/B measurements.");
    m.def("set_stream_width", &set_stream_width, nb::arg("bytes"),
          "The streaming store a staged row is written with: 64 (AVX-512), 32 (AVX2, the default where the CPU has "
          "it) or 16 bytes, capped at the CPU's; returns the previous. For tests and A/B measurements.");
    m.def("set_wide_tiles", &set_wide_tiles, nb::arg("on"),
          "Transpose dimension-major tiles 2G elements at a time with AVX2 (the default where the CPU has it), or "
          "G at a time with SSE2; returns the previous setting. For tests and A/B measurements.");
    m.def("copy_rows", &copy_rows, nb::arg("dst").noconvert(), nb::arg("src").noconvert(),  // never a copy of dst
          "Copy every row of src ([..., row] bytes, the last axis contiguous, any strides) into the same place "
          "of dst (the same shape); the GIL is released. They must not overlap.");
    m.def("stage_pages", &stage_pages, nb::arg("dst").noconvert(), nb::arg("comps"), nb::arg("h0"), nb::arg("units"),
          nb::arg("hu"), nb::arg("T"), nb::arg("segs").noconvert(), nb::arg("stream") = false,
          "One layer of a rank's share, whole heads per unit: dst ([U, n, hu, C, T, rb] bytes, flat) from the C "
          "components [tokens, heads, rb] (heads h0 .. h0 + U * hu), by segments (j0, s0, m) int64 [k, 3]; the "
          "rows of a partial last page are zeroed; every index checked; the GIL is released. stream: streaming "
          "stores where rows and places are whole cache lines (staging, which this thread does not read again); "
          "returns whether any were.");
    m.def("gather_rows", &gather_rows, nb::arg("dst").noconvert(), nb::arg("src").noconvert(), nb::arg("base").noconvert(),
          nb::arg("sel").noconvert(), nb::arg("emap").noconvert(), nb::arg("elem_bytes"), nb::arg("stream") = false,
          nb::arg("dst_rows").noconvert() = nb::none(),
          "Row r of dst ([R, D * B]) = the D elements of B bytes at src[base[r] + emap[sel[r], d] * B] (src: flat "
          "bytes; base: int64 bytes, < 0 zeroes the row; sel: int32; emap: int32 [M, D]), every address checked. "
          "stream: as stage_pages'; dst_rows: int64 [R], a permutation: entry r fills row dst_rows[r] (a table in "
          "its source's order, kvcodec.source_order); returns whether any row was streamed.");
    m.def("scatter_rows", &scatter_rows, nb::arg("dst").noconvert(), nb::arg("base").noconvert(),
          nb::arg("sel").noconvert(), nb::arg("emap").noconvert(), nb::arg("elem_bytes"), nb::arg("src").noconvert(),
          nb::arg("src_off").noconvert(),
          "The inverse of gather_rows: the D elements of B bytes at dst[base[r] + emap[sel[r], d] * B] = row r of "
          "src (flat bytes, its row at byte src_off[r]; base < 0: row r goes nowhere), every address checked "
          "before any is written; the GIL is released for the copy.");
}
