// pdpush's native row copies (``_copy``), for the KV codec (pdpush/kvcodec.py): the engine's gather of
// token-major KV rows into head-major staging pages, at memory speed. No UCX: this module builds alone
// (``-C cmake.define.PDPUSH_DATAPLANE=OFF``) for an engine's venv that has no data plane.
//
// The rows are walked in the source's memory order (its outer axes sorted by stride), each one memcpy, so
// the reads stream and the writes go to a few sequential places (a page per head): measured here, a
// token-major layer into head-major pages ran at memcpy speed this way, and at 0.65x in the destination's
// order (numpy's, the reads then stride over the whole layer once per head).

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace nb = nanobind;

namespace {

constexpr size_t kMaxDims = 8;

using Dst = nb::ndarray<uint8_t, nb::device::cpu>;        // any strides (in bytes: the elements are bytes)
using Src = nb::ndarray<const uint8_t, nb::device::cpu>;  // read-only arrays too

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
        const int64_t dsi = ds[inner], ssi = ss[inner];
        for (size_t n = shape[inner]; n; --n, d += dsi, s += ssi) std::memcpy(d, s, row);
        size_t i = inner;
        for (; i-- > 0;) {
            if (++idx[i] < shape[i]) break;
            idx[i] = 0;
        }
        if (i == static_cast<size_t>(-1)) return;
    }
}

}  // namespace

NB_MODULE(_copy, m) {
    m.doc() = "pdpush's native row copies for the KV codec (no UCX)";
    m.def("copy_rows", &copy_rows, nb::arg("dst").noconvert(), nb::arg("src").noconvert(),  // never a copy of dst
          "Copy every row of src ([..., row] bytes, the last axis contiguous, any strides) into the same place "
          "of dst (the same shape); the GIL is released. They must not overlap.");
}
