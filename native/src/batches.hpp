// One endpoint's posted batches of one-sided puts, each closed by a flush (pdpush/transport/base.py).
//
// A batch is some puts plus one ucp_ep_flush_nbx; it completes when its flush (and so every put before
// it) has completed remotely. Batches of one endpoint complete in the order they were posted. A batch
// still in progress past its deadline completes TIMED_OUT, and a failed batch takes every batch behind
// it with it (CANCELED): nothing after a failure on an endpoint can be trusted. The caller owns the
// UCX worker and progresses it on the thread that posts (notes/ucx.md); nothing here waits.
#pragma once

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pdpush {

struct UcpFailure : std::runtime_error {
    UcpFailure(const std::string &what, ucs_status_t st)
        : std::runtime_error(what + ": " + ucs_status_string(st)), status(st) {}
    ucs_status_t status;
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
    ~Batches() { drop_all(); }

    // Post the puts (each split at max_put bytes) and one flush, due by ``deadline`` (CLOCK_MONOTONIC
    // seconds); returns the puts posted. On an error it throws UcpFailure, the batch's requests freed; puts
    // issued before the failing call may still land (the caller takes the endpoint for dead: never settled).
    size_t post(const std::vector<Op> &ops, double deadline) {
        Batch b;
        b.deadline = deadline;
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

    // The statuses of the head batches that have finished by ``now``, in posting order: 0 done, < 0 a UCX
    // error, UCS_ERR_TIMED_OUT past its deadline; after a failure, CANCELED for every batch behind it.
    std::vector<int> reap(double now) {
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
            if (left && b.status == UCS_OK) {
                if (now <= b.deadline) break;  // the head is in progress: the ones behind it wait
                b.status = UCS_ERR_TIMED_OUT;  // a stalled or partitioned peer
            }
            const int status = b.status;
            drop_head();
            out.push_back(status);
            if (status != UCS_OK) {
                for (size_t i = q_.size(); i; --i) out.push_back(UCS_ERR_CANCELED);
                drop_all();
                break;
            }
        }
        return out;
    }

    // Forget every batch (the endpoint closes or failed): UCX completes their requests later, we drop our
    // references.
    void drop_all() {
        while (!q_.empty()) drop_head();
    }

    size_t size() const { return q_.size(); }

  private:
    struct Batch {
        std::vector<void *> reqs;
        int status = UCS_OK;
        double deadline = 0;
    };

    void drop_head() {
        for (void *r : q_.front().reqs) ucp_request_free(r);
        q_.pop_front();
    }

    [[noreturn]] static void fail(Batch &b, const char *what, ucs_status_t st) {
        for (void *r : b.reqs) ucp_request_free(r);
        b.reqs.clear();
        throw UcpFailure(what, st);
    }

    ucp_ep_h ep_;
    ucp_rkey_h rkey_;
    uint64_t max_put_;
    std::deque<Batch> q_;
};

}  // namespace pdpush
