// pdpush's native data plane: one endpoint's posted batches of one-sided puts, each closed by a flush,
// posted and reaped in C++ (the ctypes path cost 30-36 us per batch in the interpreter).
//
// A batch is the puts of one loop pass to one receiver plus one ucp_ep_flush_nbx; it completes when
// its flush (and so every put before it) has completed remotely. Batches of one endpoint complete in
// the order they were posted (transport/base.py). The caller owns the UCX worker and progresses it on
// the thread that posts (notes/ucx.md); nothing here waits or keeps a thread.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <ucp/api/ucp.h>

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

struct UcpFailure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

using Op = std::tuple<uint64_t, uint64_t, uint64_t>;  // (local address, remote address, bytes)

class Batches {
  public:
    Batches(uintptr_t ep, uintptr_t rkey, uint64_t max_put)
        : ep_(reinterpret_cast<ucp_ep_h>(ep)), rkey_(reinterpret_cast<ucp_rkey_h>(rkey)), max_put_(max_put) {
        if (!ep || !rkey || !max_put) throw std::invalid_argument("Batches needs an endpoint, an rkey and max_put > 0");
    }
    Batches(const Batches &) = delete;
    Batches &operator=(const Batches &) = delete;
    // The owner drops every batch (drop_all) before the worker goes; a request freed after that would crash.
    ~Batches() = default;

    // Post the puts (each split at max_put bytes) and one flush; returns the puts posted. On an error
    // nothing of the batch stays posted as far as the caller knows: its requests are freed and it raises.
    size_t post(const std::vector<Op> &ops) {
        Batch b;
        size_t puts = 0;
        ucp_request_param_t param{};
        param.op_attr_mask = 0;  // defaults, no callback: completion is polled (reap)
        for (const auto &[src, dst, nbytes] : ops) {
            for (uint64_t off = 0; off < nbytes; off += max_put_) {
                const uint64_t size = std::min(max_put_, nbytes - off);
                ucs_status_ptr_t r = ucp_put_nbx(ep_, reinterpret_cast<void *>(src + off), size, dst + off, rkey_, &param);
                if (UCS_PTR_IS_ERR(r)) fail(b, "ucp_put_nbx", UCS_PTR_STATUS(r));
                if (r != nullptr) b.reqs.push_back(r);
                ++puts;
            }
        }
        ucs_status_ptr_t r = ucp_ep_flush_nbx(ep_, &param);
        if (UCS_PTR_IS_ERR(r)) fail(b, "ucp_ep_flush_nbx", UCS_PTR_STATUS(r));
        if (r != nullptr) b.reqs.push_back(r);
        q_.push_back(std::move(b));
        return puts;
    }

    // The statuses of the head batches that have finished, in posting order (0: done, < 0: a UCX
    // error). It stops at the first batch still in progress, and after the first that failed.
    std::vector<int> reap() {
        std::vector<int> out;
        while (!q_.empty()) {
            Batch &b = q_.front();
            size_t left = 0;
            for (void *r : b.reqs) {
                const ucs_status_t st = ucp_request_check_status(r);
                if (st == UCS_INPROGRESS) {
                    b.reqs[left++] = r;
                    continue;
                }
                ucp_request_free(r);
                if (st != UCS_OK && b.status == UCS_OK) b.status = st;
            }
            b.reqs.resize(left);
            if (left && b.status == UCS_OK) break;  // the head is in progress: the ones behind it wait
            const int status = b.status;
            drop_head();
            out.push_back(status);
            if (status != UCS_OK) break;
        }
        return out;
    }

    // Forget the head batch (its deadline passed): UCX completes its requests later, we drop our reference.
    void drop_head() {
        if (q_.empty()) return;
        for (void *r : q_.front().reqs) ucp_request_free(r);
        q_.pop_front();
    }

    void drop_all() {
        while (!q_.empty()) drop_head();
    }

    size_t size() const { return q_.size(); }

  private:
    struct Batch {
        std::vector<void *> reqs;
        int status = UCS_OK;
    };

    [[noreturn]] static void fail(Batch &b, const char *what, ucs_status_t st) {
        for (void *r : b.reqs) ucp_request_free(r);
        b.reqs.clear();
        throw UcpFailure(std::string(what) + ": " + ucs_status_string(st));
    }

    ucp_ep_h ep_;
    ucp_rkey_h rkey_;
    uint64_t max_put_;
    std::deque<Batch> q_;
};

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
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + std::chrono::duration<double>(timeout_s);
    auto settle = [&](size_t keep) {
        while (flights.size() > keep) {
            void *r = flights.front();
            if (r != nullptr) {
                ucs_status_t st;
                while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
                    ucp_worker_progress(w);
                    if (std::chrono::steady_clock::now() > deadline) throw UcpFailure("put_loop: timed out");
                }
                ucp_request_free(r);
                if (st != UCS_OK) throw UcpFailure(std::string("put_loop flush: ") + ucs_status_string(st));
            }
            flights.pop_front();
        }
    };
    for (uint32_t i = 0; i < count; ++i) {
        const uint64_t off = static_cast<uint64_t>(i % slots) * nbytes;
        ucs_status_ptr_t p = ucp_put_nbx(e, reinterpret_cast<void *>(src + off), nbytes, dst + off, k, &param);
        if (UCS_PTR_IS_ERR(p)) throw UcpFailure(std::string("put_loop put: ") + ucs_status_string(UCS_PTR_STATUS(p)));
        if (p != nullptr) ucp_request_free(p);  // the flush after it completes only once it has
        ucs_status_ptr_t f = ucp_ep_flush_nbx(e, &param);
        if (UCS_PTR_IS_ERR(f)) throw UcpFailure(std::string("put_loop flush: ") + ucs_status_string(UCS_PTR_STATUS(f)));
        flights.push_back(f);
        ucp_worker_progress(w);
        settle(window - 1);
    }
    settle(0);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void register_ring(nb::module_ &m);  // ring.cpp

NB_MODULE(_dataplane, m) {
    m.doc() = "pdpush's native data plane: UCX puts and flushes posted, and their completions reaped, in C++";
    nb::exception<UcpFailure>(m, "UcpError");
    nb::class_<Batches>(m, "Batches", "One endpoint's posted batches (puts + one flush each), in posting order.")
        .def(nb::init<uintptr_t, uintptr_t, uint64_t>(), nb::arg("ep"), nb::arg("rkey"), nb::arg("max_put"))
        .def("post", &Batches::post, nb::arg("ops"),
             "Post (src, dst, nbytes) puts and one flush; returns the puts posted. Raises UcpError.")
        .def("reap", &Batches::reap,
             "Statuses of the finished head batches, in order (0 done, < 0 failed); stops at one in progress.")
        .def("drop_head", &Batches::drop_head, "Forget the head batch (its deadline passed).")
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
    register_ring(m);
}
