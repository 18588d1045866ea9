// Python's view of a hand-over ring (ring.hpp): the tests read rings with it; the sender's rings are
// read by its Pusher (pusher.cpp).

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>
#include <vector>

#include "ring.hpp"

namespace nb = nanobind;

void register_ring(nb::module_ &m) {
    nb::class_<pdpush::Ring>(m, "Ring", "A reader of one engine connection's hand-over ring (pdpush/ring.py).")
        .def(nb::init<uintptr_t, uint32_t>(), nb::arg("address"), nb::arg("slots"))
        .def(
            "take",
            [](pdpush::Ring &ring, uint32_t limit) {
                std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> out;
                if (!limit) limit = ring.slots();  // a ring's worth: everything written before the call
                pdpush::Record rec;
                while (out.size() < limit && ring.next(rec)) out.emplace_back(rec.handle, rec.first, rec.layers);
                return out;
            },
            nb::arg("limit") = 0,
            "Records in order as (handle, first layer, layers), a finish record as (handle, 0, 0), their slots given "
            "back to the engine; at most "
            "``limit`` (0: the ring's slots, which is every record written before the call).")
        .def("pending", &pdpush::Ring::pending, "Whether a record waits (without taking it).")
        .def_prop_ro("taken", &pdpush::Ring::taken, "Records taken so far.");
}
