// pdpush's native data plane, the module: one endpoint's posted batches (batches.hpp), the sender's
// per-layer path (pusher.cpp), the hand-over rings (ring.cpp), and the benchmarks' raw put loop.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <dlfcn.h>
#include <ucp/api/ucp.h>

#include "batches.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace {

using pdpush::Batches;
using pdpush::UcpFailure;

// The reference the benchmarks hold the sender to (pdpush_tools/bench/ceiling.py): ``count`` puts of
// ``nbytes``, each followed by its own flush, cycling over ``slots`` layer-sized places, with at most
// ``window`` put+flush pairs in flight, all in C++ on the calling thread. Returns the seconds taken.
double put_loop(uintptr_t worker, uintptr_t ep, uintptr_t rkey, uint64_t src, uint64_t dst, uint64_t nbytes,
                uint32_t slots, uint32_t count, uint32_t window, double timeout_s) {
    auto w = reinterpret_cast<ucp_worker_h>(worker);
    auto e = reinterpret_cast<ucp_ep_h>(ep);
    auto k = reinterpret_cast<ucp_rkey_h>(rkey);
    if (!w || !e || !k || !nbytes || !slots || !window) throw std::invalid_argument("put_loop: bad arguments");
    nb::gil_scoped_release unlocked;
    ucp_request_param_t param{};
    std::deque<void *> flights;  // each pair's flush, or nullptr where it completed at once
    struct FreeLeft {  // on a throw, the flushes still in flight are freed: UCX releases each once it completes
        std::deque<void *> &left;
        ~FreeLeft() {
            for (void *r : left)
                if (r != nullptr) ucp_request_free(r);
        }
    } free_left{flights};
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + std::chrono::duration<double>(timeout_s);
    auto settle = [&](size_t keep) {
        while (flights.size() > keep) {
            void *r = flights.front();
            ucs_status_t st = UCS_OK;
            if (r != nullptr) {
                while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
                    ucp_worker_progress(w);
                    if (std::chrono::steady_clock::now() > deadline) throw UcpFailure("put_loop", UCS_ERR_TIMED_OUT);
                }
                ucp_request_free(r);
            }
            flights.pop_front();
            if (st != UCS_OK) throw UcpFailure("put_loop flush", st);
        }
    };
    for (uint32_t i = 0; i < count; ++i) {
        const uint64_t off = static_cast<uint64_t>(i % slots) * nbytes;
        ucs_status_ptr_t p = ucp_put_nbx(e, reinterpret_cast<void *>(src + off), nbytes, dst + off, k, &param);
        if (UCS_PTR_IS_ERR(p)) throw UcpFailure("put_loop put", UCS_PTR_STATUS(p));
        if (p != nullptr) ucp_request_free(p);  // the flush after it completes only once it has
        ucs_status_ptr_t f = ucp_ep_flush_nbx(e, &param);
        if (UCS_PTR_IS_ERR(f)) throw UcpFailure("put_loop flush", UCS_PTR_STATUS(f));
        flights.push_back(f);
        ucp_worker_progress(w);
        settle(window - 1);
    }
    settle(0);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void register_ring(nb::module_ &m);    // ring.cpp
void register_pusher(nb::module_ &m);  // pusher.cpp

NB_MODULE(_dataplane, m) {
    m.doc() = "pdpush's native data plane: UCX puts and flushes posted, and their completions reaped, in C++";
    nb::exception<UcpFailure>(m, "UcpError");
    m.attr("TIMED_OUT") = static_cast<int>(UCS_ERR_TIMED_OUT);
    m.attr("CANCELED") = static_cast<int>(UCS_ERR_CANCELED);
    nb::class_<Batches>(m, "Batches", "One endpoint's posted batches (puts + one flush each), in posting order.")
        .def(nb::init<uintptr_t, uintptr_t, uint64_t>(), nb::arg("ep"), nb::arg("rkey"), nb::arg("max_put"))
        .def("post", &Batches::post, nb::arg("ops"), nb::arg("deadline"),
             "Post (src, dst, nbytes) puts and one flush, due by ``deadline`` (time.monotonic() seconds); returns "
             "the puts posted. Raises UcpError.")
        .def("reap", &Batches::reap, nb::arg("now"),
             "Statuses of the finished head batches, in order (0 done, < 0 failed, TIMED_OUT past its deadline, "
             "then CANCELED for each batch behind a failure); stops at one in progress.")
        .def("drop_all", &Batches::drop_all, "Forget every batch (the endpoint closes).")
        .def("__len__", &Batches::size);
    m.def("put_loop", &put_loop, nb::arg("worker"), nb::arg("ep"), nb::arg("rkey"), nb::arg("src"), nb::arg("dst"),
          nb::arg("nbytes"), nb::arg("slots"), nb::arg("count"), nb::arg("window"), nb::arg("timeout_s"),
          "The benchmarks' raw reference: count x (put + its own flush), window pairs in flight; seconds.");
    m.def(
        "progress", [](uintptr_t worker) { return ucp_worker_progress(reinterpret_cast<ucp_worker_h>(worker)); },
        nb::arg("worker"), "One ucp_worker_progress; returns the events it handled.");
    m.def(
        "status_string", [](int status) { return std::string(ucs_status_string(static_cast<ucs_status_t>(status))); },
        nb::arg("status"));
    m.def(
        "libucp_path",
        [] {
            Dl_info info{};
            if (!dladdr(reinterpret_cast<void *>(&ucp_get_version), &info) || !info.dli_fname) return std::string();
            return std::string(info.dli_fname);
        },
        "The file of the libucp this module's UCX calls go to, as the dynamic linker resolved it.");
    m.def("libucp_version", [] { return std::string(ucp_get_version_string()); },
          "The version of that libucp (ucp_get_version_string).");
    register_ring(m);
    register_pusher(m);
}
