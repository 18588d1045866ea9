// The sender's reader of one engine connection's hand-over ring (pdpush/ring.py has the format and the
// engine's side).
//
// Each prefill engine connection has a ring of u64 slots in the sender's staging segment. The engine
// stores one record per hand-over into the next slot with a compare-and-swap from 0; the sender takes
// records in order, writing 0 back, so a slot is free exactly when it reads 0 and no index is shared.
// A record is one aligned 8-byte word, so it is never seen half written, and the engine's CAS orders
// the staged bytes before it. take() acquires each record before anything reads the bytes it names.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace pdpush {

struct Record {
    uint32_t handle, first, layers;  // a finish record: first = layers = 0
    bool finish;                     // the engine's Finish of request ``handle`` (pdpush/ring.py FINISH)
};

class Ring {
  public:
    Ring(uintptr_t address, uint32_t slots) : slots_(reinterpret_cast<uint64_t *>(address)), n_(slots) {
        if (!address || address % 8 || !slots) throw std::invalid_argument("Ring needs an 8-byte aligned address and slots > 0");
    }

    // The next record, its slot given back to the engine; false when none waits.
    bool next(Record &rec) {
        uint64_t *slot = &slots_[tail_ % n_];
        const uint64_t w = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (!w) return false;
        __atomic_store_n(slot, uint64_t{0}, __ATOMIC_RELEASE);
        ++tail_;
        if (w >> 62 & 1)
            rec = {static_cast<uint32_t>(w), 0, 0, true};
        else
            rec = {static_cast<uint32_t>(w), static_cast<uint32_t>((w >> 32) & 0x3fff),
                   static_cast<uint32_t>(((w >> 46) & 0x3fff) + 1), false};
        return true;
    }

    bool pending() const { return __atomic_load_n(&slots_[tail_ % n_], __ATOMIC_ACQUIRE) != 0; }
    uint32_t slots() const { return n_; }
    uint64_t taken() const { return tail_; }

  private:
    uint64_t *slots_;
    uint32_t n_;
    uint64_t tail_ = 0;
};

}  // namespace pdpush
