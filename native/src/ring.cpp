// The sender's side of the hand-over rings (pdpush/ring.py has the format and the engine's side).
//
// Each prefill engine connection has a ring of u64 slots in the sender's staging segment. The engine
// stores one record per hand-over into the next slot with a compare-and-swap from 0; the sender takes
// records in order, writing 0 back, so a slot is free exactly when it reads 0 and no index is shared.
// A record is one aligned 8-byte word, so it is never seen half written, and the engine's CAS orders
// the staged bytes before it. take() acquires each record before anything reads the bytes it names.

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace nb = nanobind;

namespace {

class Ring {
  public:
    Ring(uintptr_t address, uint32_t slots) : slots_(reinterpret_cast<uint64_t *>(address)), n_(slots) {
        if (!address || address % 8 || !slots) throw std::invalid_argument("Ring needs an 8-byte aligned address and slots > 0");
    }

    // The records in order (each: handle, first layer, layers), at most ``limit``; their slots freed.
    std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> take(uint32_t limit) {
        std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> out;
        if (!limit) limit = n_;  // a ring's worth: everything written before the call
        while (out.size() < limit) {
            uint64_t *slot = &slots_[tail_ % n_];
            uint64_t rec = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
            if (!rec) break;
            __atomic_store_n(slot, uint64_t{0}, __ATOMIC_RELEASE);
            ++tail_;
            out.emplace_back(static_cast<uint32_t>(rec), static_cast<uint32_t>((rec >> 32) & 0x3fff),
                             static_cast<uint32_t>(((rec >> 46) & 0x3fff) + 1));
        }
        return out;
    }

    bool pending() const { return __atomic_load_n(&slots_[tail_ % n_], __ATOMIC_ACQUIRE) != 0; }
    uint64_t taken() const { return tail_; }

  private:
    uint64_t *slots_;
    uint32_t n_;
    uint64_t tail_ = 0;
};

}  // namespace

void register_ring(nb::module_ &m) {
    nb::class_<Ring>(m, "Ring", "The sender's reader of one engine connection's hand-over ring (pdpush/ring.py).")
        .def(nb::init<uintptr_t, uint32_t>(), nb::arg("address"), nb::arg("slots"))
        .def("take", &Ring::take, nb::arg("limit") = 0,
             "Records in order as (handle, first layer, layers), their slots given back to the engine; at most "
             "``limit`` (0: the ring's slots, which is every record written before the call).")
        .def("pending", &Ring::pending, "Whether a record waits (without taking it).")
        .def_prop_ro("taken", &Ring::taken, "Records taken so far.");
    m.def(
        "fence", [] { __atomic_thread_fence(__ATOMIC_SEQ_CST); },
        "A full memory fence: the sender's idle word is visible before it looks at the rings again.");
}
