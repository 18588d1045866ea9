// The sender's per-layer path, without the interpreter (pdpush/sender.py drives it; docs/layout.md,
// "The per-layer path").
//
// The session (Python) decides each request once: after its AllocResponse it hands the Pusher the
// request's put plan (sessions/put_plan.py) and, as staging is granted, each layer's block. From then on
// a layer handed over (a record in an engine's ring, or a LayerReady the session checked) is checked
// against that plan here, its puts are posted (one batch and one flush per receiver per pass), and when
// the flush of every TP rank's share has completed, its readiness words are put and it is reported
// landed; once the words' own flush completes, that is reported too (take_words: a request that completes
// on the data path is done when all its layers' words are in). The session hears back in batches: layers
// landed, words in, receivers failed, records it must answer.
//
// A finish record (the engine's Finish, after its layers' records in the same ring) is handed to the session
// as it is (take_finished): the session checks and decides it as it would a Finish message.
//
// A record is refused, and handed to the session to answer, unless it names a request planned here,
// comes from one of that request's ranks, stays in that rank's stage, repeats no layer, and every layer
// that moves bytes has its block granted. Addresses come only from the plan and the grants, never from
// the shared segment an engine can write. The UCX worker is the caller's: it is progressed here, on the
// thread that posts (notes/ucx.md), and nothing here waits.

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <errno.h>
#include <poll.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "batches.hpp"
#include "ring.hpp"

namespace nb = nanobind;

namespace {

using pdpush::Batches;
using pdpush::Op;

constexpr uint32_t kWordsOnly = 0xFFFFFFFFu;  // a Share of readiness words only: lands no layer

// Why a hand-over was refused (pdpush/sessions/put_plan.py has the same numbers).
enum Refusal : int { kOk = 0, kUnknown = 1, kNotYours = 2, kRange = 3, kDuplicate = 4, kUngranted = 5 };

using Span = std::tuple<uint64_t, uint64_t, uint64_t>;  // (source, destination, bytes)
using Spans = std::vector<Span>;
// (handle, layer, seconds from post to flush (< 0: moved nothing), when it landed: monotonic seconds)
using Landed = std::tuple<uint32_t, uint32_t, double, double>;
using Refused = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, int>;  // (connection, handle, first, n, why)

double monotonic() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  // time.monotonic()'s clock
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Layer {
    uint32_t group;  // its spans: each rank's ``ranges[group]``, the request's ``ready[group]``
    uint64_t dst;    // its place in the receiver's pool; spans' destinations are relative to it
    uint64_t ready;  // its readiness words in the pool (ready spans' destinations are relative to it)
    uint64_t bytes;  // its staging block (0: no new bytes, a share lands as it is handed over)
    uint32_t left;   // shares not flushed yet (one per TP rank of its stage)
    uint64_t block = 0;  // its staging block's offset + 1, once granted
};

struct Rank {
    uint32_t first, end;         // its stage's layers
    std::vector<Spans> ranges;   // by group: (offset in the layer's block, offset from Layer::dst, bytes)
    std::vector<uint8_t> posted;  // by layer of its stage
};

struct Req {
    uint32_t eid;
    uint32_t layers_left = 0;  // layers not landed, and layers whose readiness words are not in: wait() returns
    uint32_t words_left = 0;   // to the session once both are 0 (it may complete the request)
    std::vector<Layer> layers;
    std::vector<Spans> ready;  // by group: (staging address of the lease words, offset from Layer::ready, bytes)
    std::unordered_map<uint32_t, Rank> ranks;  // by connection
};

struct Share {
    uint32_t handle, layer;
};

struct Flight {
    std::vector<Share> shares;
    double posted;
};

struct Ep {
    std::unique_ptr<Batches> batches;
    std::deque<Flight> flights;
    std::vector<Op> ops;         // this pass's puts, posted together by post()
    std::vector<Share> shares;
    bool dead = false;
    uint64_t base = 0, end = 0;  // the receiver's pool as its HelloAck gives it: every put lands inside
};

// [at + off, at + off + n) lies inside [lo, hi), computed without overflow.
static bool inside(uint64_t lo, uint64_t hi, uint64_t at, uint64_t off, uint64_t n) {
    return at >= lo && at <= hi && off <= hi - at && n <= hi - at - off;
}

class Pusher {
  public:
    Pusher(uintptr_t worker, uintptr_t staging, uint64_t staging_bytes, uint64_t max_put, double timeout_s)
        : worker_(reinterpret_cast<ucp_worker_h>(worker)), staging_(staging), staging_bytes_(staging_bytes),
          max_put_(max_put), timeout_(timeout_s) {
        if (!worker || !staging || !staging_bytes || !max_put || timeout_s <= 0)
            throw std::invalid_argument("Pusher needs a worker, staging, max_put and a timeout");
    }
    Pusher(const Pusher &) = delete;
    Pusher &operator=(const Pusher &) = delete;

    // ---- receivers ----
    // ``base``, ``bytes``: the receiver's pool (KV, readiness words, state), which no plan's put may leave.
    void add_endpoint(uint32_t eid, uintptr_t ep, uintptr_t rkey, uint64_t base, uint64_t bytes) {
        if (!bytes || base > UINT64_MAX - bytes) throw std::invalid_argument("a receiver's pool is empty or wraps");
        Ep e;
        e.batches = std::make_unique<Batches>(ep, rkey, max_put_);
        e.base = base;
        e.end = base + bytes;
        drop_endpoint(eid);  // one under this id already: its flights leave the count with it
        eps_[eid] = std::move(e);
    }

    // Forget a receiver's batches (its requests are failed by the session): UCX completes them later.
    void drop_endpoint(uint32_t eid) {
        auto it = eps_.find(eid);
        if (it == eps_.end()) return;
        in_flight_ -= it->second.flights.size();
        eps_.erase(it);
    }

    // ---- engine connections' rings ----
    void add_ring(uint32_t cid, uintptr_t address, uint32_t slots) {
        if (address < staging_ || address + uint64_t{slots} * 8 > staging_ + staging_bytes_)
            throw std::invalid_argument("a ring outside staging");
        rings_.insert_or_assign(cid, pdpush::Ring(address, slots));
    }
    void drop_ring(uint32_t cid) { rings_.erase(cid); }

    // ---- requests ----
    void add_request(uint32_t handle, uint32_t eid, const std::vector<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>> &layers,
                     const std::vector<Spans> &ready, uint32_t tp) {
        if (!tp || layers.size() > (1u << 14)) throw std::invalid_argument("a plan needs tp > 0 and at most 2^14 layers");
        const Ep &e = ep(eid);
        Req r;
        r.eid = eid;
        r.ready = ready;
        for (const auto &[group, dst, rdy, bytes] : layers) {
            if (group >= ready.size() || bytes > staging_bytes_) throw std::invalid_argument("a layer's group or block does not fit");
            if (bytes && !inside(e.base, e.end, dst, 0, 1)) throw std::invalid_argument("a layer outside the receiver's pool");
            for (const auto &[src, off, n] : ready[group])  // its readiness words: from staging, into the pool
                if (!inside(e.base, e.end, rdy, off, n) || !inside(staging_, staging_ + staging_bytes_, src, 0, n))
                    throw std::invalid_argument("a layer's readiness words outside the receiver's pool or staging");
            r.layers.push_back(Layer{group, dst, rdy, bytes, tp});
            r.words_left += !ready[group].empty();
        }
        r.layers_left = static_cast<uint32_t>(r.layers.size());
        reqs_.insert_or_assign(handle, std::move(r));
    }

    void add_rank(uint32_t handle, uint32_t cid, uint32_t first, uint32_t end, const std::vector<Spans> &ranges) {
        Req &r = req(handle);
        if (!(first < end && end <= r.layers.size()) || ranges.size() != r.ready.size())
            throw std::invalid_argument("a rank's stage or groups do not fit its request's plan");
        if (r.ranks.count(cid)) throw std::invalid_argument("a connection already pushes a rank of this request");
        const Ep &e = ep(r.eid);
        for (uint32_t l = first; l < end; ++l) {  // every span inside its layer's block and the pool (if it moves)
            const Layer &L = r.layers[l];
            if (!L.bytes) continue;
            for (const auto &[src, dst, n] : ranges[L.group])
                if (n > L.bytes || src > L.bytes - n || !inside(e.base, e.end, L.dst, dst, n))
                    throw std::invalid_argument("a rank's span outside its layer's block or the receiver's pool");
        }
        r.ranks.insert_or_assign(cid, Rank{first, end, ranges, std::vector<uint8_t>(end - first)});
    }

    void grant(uint32_t handle, uint32_t layer, uint64_t offset) {
        Req &r = req(handle);
        if (layer >= r.layers.size() || r.layers[layer].bytes > staging_bytes_ ||
            offset > staging_bytes_ - r.layers[layer].bytes)
            throw std::invalid_argument("a grant outside its plan or staging");
        r.layers[layer].block = offset + 1;
    }

    void drop_request(uint32_t handle) { reqs_.erase(handle); }  // later completions naming it are dropped

    // ---- the per-layer path ----
    // Connection ``cid`` hands over layers [first, first + n) of request ``handle``: 0 and its puts queued
    // for post(), or why not (nothing of it is taken then).
    int hand(uint32_t cid, uint32_t handle, uint32_t first, uint32_t n) {
        if (int why = check(cid, handle, first, n)) return why;
        Req &r = reqs_.find(handle)->second;
        Rank &k = r.ranks.find(cid)->second;
        Ep &e = eps_.find(r.eid)->second;
        for (uint32_t l = first; l < first + n; ++l) {
            k.posted[l - k.first] = 1;
            Layer &L = r.layers[l];
            if (!L.bytes) {
                share(r, handle, l, -1.0, monotonic());  // nothing moved: no post-to-flush time
                continue;
            }
            const uint64_t src0 = staging_ + L.block - 1;
            for (const auto &[src, dst, nbytes] : k.ranges[L.group]) {
                e.ops.emplace_back(src0 + src, L.dst + dst, nbytes);
                bytes_ += nbytes;
            }
            e.shares.push_back({handle, l});
        }
        layers_ += n;
        return kOk;
    }

    // Whether hand() would take it: 0, or why not (nothing changes either way).
    int check(uint32_t cid, uint32_t handle, uint32_t first, uint32_t n) const {
        auto it = reqs_.find(handle);
        if (it == reqs_.end()) return kUnknown;
        const Req &r = it->second;
        auto rk = r.ranks.find(cid);
        if (rk == r.ranks.end()) return kNotYours;
        const Rank &k = rk->second;
        auto ep = eps_.find(r.eid);
        if (ep == eps_.end() || ep->second.dead) return kUnknown;  // its receiver failed: the session ends it
        if (!n || first < k.first || first >= k.end || n > k.end - first) return kRange;
        for (uint32_t l = first; l < first + n; ++l) {
            if (k.posted[l - k.first]) return kDuplicate;
            if (r.layers[l].bytes && !r.layers[l].block) return kUngranted;
        }
        return kOk;
    }

    // Take the records in ``cid``'s ring (every ring when cid < 0), a ring's worth at most each: how many,
    // and those refused.
    std::pair<uint64_t, std::vector<Refused>> take(int64_t cid) {
        std::vector<Refused> refused;
        uint64_t taken = 0;
        auto one = [&](uint32_t id, pdpush::Ring &ring) {
            pdpush::Record rec;
            for (uint32_t i = 0; i < ring.slots() && ring.next(rec); ++i) {
                ++taken;
                if (rec.finish) {
                    finished_.emplace_back(id, rec.handle);
                    continue;
                }
                if (int why = hand(id, rec.handle, rec.first, rec.layers)) refused.emplace_back(id, rec.handle, rec.first, rec.layers, why);
            }
        };
        if (cid < 0) {
            for (auto &[id, ring] : rings_) one(id, ring);
        } else if (auto it = rings_.find(static_cast<uint32_t>(cid)); it != rings_.end()) {
            one(it->first, it->second);
        }
        records_ += taken;
        return {taken, std::move(refused)};
    }

    // Post what was handed over since the last call (and the readiness words of what landed): one batch,
    // one flush, per receiver.
    void post() {
        const double now = monotonic();
        bool posted = false;
        for (auto &[eid, e] : eps_) {
            if (e.ops.empty() && e.shares.empty()) continue;
            if (e.dead) {
                e.ops.clear();
                e.shares.clear();
                continue;
            }
            try {
                e.batches->post(e.ops, now + timeout_);
            } catch (const pdpush::UcpFailure &f) {
                die(eid, e, f.status);
                continue;
            }
            e.ops.clear();
            e.flights.push_back(Flight{std::move(e.shares), now});
            e.shares.clear();
            ++in_flight_;
            posted = true;
        }
        // From when the posts returned: a put into a peer's memory mapped here (shared memory: UCX's "short"
        // protocol) is the copy itself, done inside ucp_put_nbx, and its flush then completes on progress,
        // which has no fd event. Counted from before the posts, a batch that took longer than spin_s to copy
        // (32 layers of 1 MiB: ~5 ms here) left its flush to wait()'s next sleep, up to 2 ms with puts in flight
        // (measured: 6.9 against 4.8 ms for the request).
        if (posted) spin_until_ = monotonic() + spin_s_;
    }

    // Progress the worker, reap every receiver's batches, put the readiness words of the layers that
    // landed; returns (landed: (handle, layer, seconds, at), failed: (receiver, UCX status)) since the last call
    // (wait() gathers them too, for this to return).
    std::pair<std::vector<Landed>, std::vector<std::pair<uint32_t, int>>> poll(double now) {
        reap(now < 0 ? monotonic() : now);
        std::pair<std::vector<Landed>, std::vector<std::pair<uint32_t, int>>> out{std::move(landed_), std::move(failed_)};
        landed_.clear();
        failed_.clear();
        return out;
    }

    // The sender's loop between two looks of the session: hand-overs taken from the rings (the doorbell woke
    // it, or the idle word was clear), their puts posted, completions reaped, without the interpreter. Returns
    // when the session has something to do: one of ``fds`` is readable (its sockets, its lifelines), a request
    // has every layer landed and every readiness word in, a receiver failed, a record was refused, a finish
    // record was taken (take_finished), anything landed where ``eager`` (engines wait for staging blocks, or
    // layers carry checksums), or ``timeout_s`` passed. After a post or a landing it spins on progress for
    // ``spin_s`` (shared-memory completions need progress, not an fd event), looking at ``fds`` every 50 us,
    // then sleeps on the fds, the doorbell and the worker's event fd, at most 2 ms at a time while puts
    // are in flight (the millisecond, truncated, plus one). ``idle`` is the word engines read to know whether to ring.
    // Returns (``fds`` readable, doorbell bytes drained, records refused); the landings wait for poll().
    std::tuple<std::vector<int>, uint64_t, std::vector<Refused>> wait(double timeout_s, const std::vector<int> &fds,
                                                                       int doorbell, int worker_fd, uintptr_t idle,
                                                                       double spin_s, bool eager) {
        if (idle && (idle < staging_ || idle + 8 > staging_ + staging_bytes_ || idle % 8))
            throw std::invalid_argument("the idle word is outside staging");
        auto *idle_word = reinterpret_cast<uint64_t *>(idle);
        std::vector<int> ready;
        std::vector<Refused> refused;
        uint64_t rung = 0;
        std::vector<pollfd> pfds;  // the session's fds, then the doorbell's, then the worker's
        for (int fd : fds) pfds.push_back({fd, POLLIN, 0});
        if (doorbell >= 0) pfds.push_back({doorbell, POLLIN, 0});
        pfds.push_back({worker_fd, POLLIN, 0});
        const nfds_t mine = fds.size();
        // the session's fds that are readable: ``ms`` 0 asks without waiting; else it sleeps on every fd
        auto look = [&](nfds_t n, int ms) {
            int rc;
            if (ms) {
                nb::gil_scoped_release unlocked;  // the daemon's other threads (metrics) run meanwhile
                rc = ::poll(pfds.data(), n, ms);
            } else {
                rc = ::poll(pfds.data(), n, 0);
            }
            const int err = errno;
            if (rc < 0 && err != EINTR)
                throw std::runtime_error("poll in the sender's wait failed: errno " + std::to_string(err));
            for (nfds_t i = 0; rc > 0 && i < mine; ++i)
                if (pfds[i].revents) ready.push_back(pfds[i].fd);
            return rc >= 0;  // false: a signal, whose handler runs in the interpreter
        };
        double now = monotonic(), looked = now;
        const double deadline = now + std::max(timeout_s, 0.0);
        spin_s_ = spin_s;
        wake_ = false;
        for (;;) {
            reap(now);
            auto no = take(-1).second;
            refused.insert(refused.end(), no.begin(), no.end());
            post();
            now = monotonic();
            if (wake_ || !ready.empty() || !refused.empty() || !failed_.empty() || !finished_.empty() ||
                (eager && (!landed_.empty() || !words_.empty())) || now >= deadline)
                break;
            if ((in_flight_ && now < spin_until_) || ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
                if (now - looked >= 50e-6) {  // spinning on progress: the sockets still get a look every 50 us
                    looked = now;
                    if (!look(mine, 0)) break;
                }
                continue;
            }
            if (idle_word && !rings_.empty()) {  // engines that write a record from now on ring (pdpush/ring.py)
                __atomic_store_n(idle_word, uint64_t{1}, __ATOMIC_RELAXED);
                __atomic_thread_fence(__ATOMIC_SEQ_CST);
                bool waiting = false;
                for (const auto &[id, ring] : rings_) waiting = waiting || ring.pending();
                if (waiting) {
                    __atomic_store_n(idle_word, uint64_t{0}, __ATOMIC_RELAXED);
                    continue;
                }
            }
            double left = deadline - now;
            if (in_flight_) left = std::min(left, 0.001);
            const bool slept = look(pfds.size(), static_cast<int>(left * 1000) + 1);
            if (idle_word) __atomic_store_n(idle_word, uint64_t{0}, __ATOMIC_RELAXED);
            looked = now = monotonic();
            if (!slept) break;
            if (doorbell >= 0 && pfds[mine].revents) {
                // a bounded drain: an engine that keeps writing cannot hold the loop here (the FIFO stays readable,
                // and the next look wakes on it again)
                char buf[4096];
                ssize_t n = 0;
                for (int reads = 0; reads < 16 && (n = ::read(doorbell, buf, sizeof buf)) > 0; ++reads)
                    rung += static_cast<uint64_t>(n);
            }
            // (a readable fd of the session's ends the wait at the top, after the rings rung meanwhile are taken)
        }
        if (ready.empty()) look(mine, 0);  // what the session has to read, whatever ended the wait
        return {std::move(ready), rung, std::move(refused)};
    }

    // The requests one of whose layers' readiness words completed since the last call, one entry per
    // layer (completion on the data path: the session counts them, pdpush/sessions/sender.py).
    std::vector<uint32_t> take_words() {
        std::vector<uint32_t> out = std::move(words_);
        words_.clear();
        return out;
    }

    // The finish records taken from the rings since the last call, in order, as (connection, request handle).
    std::vector<std::pair<uint32_t, uint32_t>> take_finished() {
        std::vector<std::pair<uint32_t, uint32_t>> out = std::move(finished_);
        finished_.clear();
        return out;
    }

    // Everything goes (the sender stops): before the worker does.
    void close() {
        eps_.clear();
        rings_.clear();
        reqs_.clear();
        in_flight_ = 0;
    }

    size_t in_flight() const { return in_flight_; }

    // Whether request ``handle``'s writes to receiver ``eid`` have settled: none is queued or in flight on its
    // endpoint (a request dropped by drop_request keeps its flights until they complete). False where the
    // endpoint failed or was dropped: its writes may still land, only the receiver closing it fences them.
    bool settled(uint32_t handle, uint32_t eid) const {
        auto it = eps_.find(eid);
        if (it == eps_.end() || it->second.dead) return false;
        const Ep &e = it->second;
        for (const Share &s : e.shares)
            if (s.handle == handle) return false;
        for (const Flight &f : e.flights)
            for (const Share &s : f.shares)
                if (s.handle == handle) return false;
        return true;
    }
    bool pending() const {  // handed over, or landed, since the last post()/poll()
        if (!landed_.empty() || !failed_.empty() || !words_.empty() || !finished_.empty()) return true;
        for (const auto &[eid, e] : eps_)
            if (!e.ops.empty() || !e.shares.empty()) return true;
        return false;
    }
    nb::dict stats() const {
        nb::dict d;
        d["handovers_ring"] = records_;
        d["layers_handed"] = layers_;
        d["bytes_put"] = bytes_;  // every rank's data puts (an MLA latent replicated over ranks goes once)
        d["puts_in_flight"] = in_flight_;
        d["plans"] = reqs_.size();
        return d;
    }

  private:
    void reap(double now) {
        ucp_worker_progress(worker_);
        for (auto &[eid, e] : eps_) {
            if (e.flights.empty()) continue;
            for (int st : e.batches->reap(now)) {
                Flight f = std::move(e.flights.front());
                e.flights.pop_front();
                --in_flight_;
                if (st != UCS_OK) {  // the statuses behind it are its CANCELED flights, which die() dropped
                    die(eid, e, static_cast<ucs_status_t>(st));
                    break;
                }
                spin_until_ = now + spin_s_;  // more may complete soon: wait() keeps progressing a while
                for (const Share &s : f.shares) {
                    auto it = reqs_.find(s.handle);
                    if (it == reqs_.end()) continue;
                    if (s.layer == kWordsOnly) {
                        words_.push_back(s.handle);  // a layer's readiness words are in the pool
                        Req &r = it->second;
                        if (r.words_left && !--r.words_left && !r.layers_left) wake_ = true;
                    } else {
                        share(it->second, s.handle, s.layer, now - f.posted, now);
                    }
                }
            }
        }
        post();
    }

    const Ep &ep(uint32_t eid) const {
        auto it = eps_.find(eid);
        if (it == eps_.end()) throw std::invalid_argument("no receiver endpoint " + std::to_string(eid));
        return it->second;
    }

    Req &req(uint32_t handle) {
        auto it = reqs_.find(handle);
        if (it == reqs_.end()) throw std::invalid_argument("no plan for request handle " + std::to_string(handle));
        return it->second;
    }

    // One rank's share of ``layer`` is in the pool; the last one lands the layer and puts its readiness words.
    void share(Req &r, uint32_t handle, uint32_t layer, double seconds, double now) {
        if (layer >= r.layers.size()) return;
        Layer &L = r.layers[layer];
        if (!L.left || --L.left) return;
        landed_.emplace_back(handle, layer, seconds, now);
        if (r.layers_left && !--r.layers_left && !r.words_left) wake_ = true;
        auto ep = eps_.find(r.eid);
        if (ep == eps_.end()) return;
        for (const auto &[src, dst, n] : r.ready[L.group]) ep->second.ops.emplace_back(src, L.ready + dst, n);
        if (!r.ready[L.group].empty())  // its flight carries the request too: settled() waits for these words
            ep->second.shares.push_back({handle, kWordsOnly});
    }

    void die(uint32_t eid, Ep &e, ucs_status_t st) {
        if (!e.dead) failed_.emplace_back(eid, static_cast<int>(st));
        e.dead = true;
        in_flight_ -= e.flights.size();
        e.flights.clear();
        e.batches->drop_all();
        e.ops.clear();
        e.shares.clear();
    }

    ucp_worker_h worker_;
    uint64_t staging_, staging_bytes_, max_put_;
    double timeout_;
    std::map<uint32_t, Ep> eps_;
    std::map<uint32_t, pdpush::Ring> rings_;
    std::unordered_map<uint32_t, Req> reqs_;
    std::vector<Landed> landed_;
    std::vector<uint32_t> words_;
    std::vector<std::pair<uint32_t, uint32_t>> finished_;  // finish records taken: (connection, handle)
    std::vector<std::pair<uint32_t, int>> failed_;
    size_t in_flight_ = 0;
    bool wake_ = false;  // a request is complete on this side (wait())
    double spin_s_ = 0, spin_until_ = 0;  // wait() spins on progress until spin_until_ (a post or a completion + spin_s_)
    uint64_t records_ = 0, layers_ = 0, bytes_ = 0;
};

}  // namespace

void register_pusher(nb::module_ &m) {
    nb::class_<Pusher>(m, "Pusher", "The sender's per-layer path: plans in, puts posted, landings out (pusher.cpp).")
        .def(nb::init<uintptr_t, uintptr_t, uint64_t, uint64_t, double>(), nb::arg("worker"), nb::arg("staging"),
             nb::arg("staging_bytes"), nb::arg("max_put"), nb::arg("timeout_s"))
        .def("add_endpoint", &Pusher::add_endpoint, nb::arg("eid"), nb::arg("ep"), nb::arg("rkey"), nb::arg("base"),
             nb::arg("bytes"))
        .def("drop_endpoint", &Pusher::drop_endpoint, nb::arg("eid"))
        .def("add_ring", &Pusher::add_ring, nb::arg("cid"), nb::arg("address"), nb::arg("slots"))
        .def("drop_ring", &Pusher::drop_ring, nb::arg("cid"))
        .def("add_request", &Pusher::add_request, nb::arg("handle"), nb::arg("eid"), nb::arg("layers"),
             nb::arg("ready"), nb::arg("tp"))
        .def("add_rank", &Pusher::add_rank, nb::arg("handle"), nb::arg("cid"), nb::arg("first"), nb::arg("end"),
             nb::arg("ranges"))
        .def("grant", &Pusher::grant, nb::arg("handle"), nb::arg("layer"), nb::arg("offset"))
        .def("drop_request", &Pusher::drop_request, nb::arg("handle"))
        .def("hand", &Pusher::hand, nb::arg("cid"), nb::arg("handle"), nb::arg("first"), nb::arg("n"))
        .def("check", &Pusher::check, nb::arg("cid"), nb::arg("handle"), nb::arg("first"), nb::arg("n"))
        .def("take", &Pusher::take, nb::arg("cid") = -1)
        .def("post", &Pusher::post)
        .def("poll", &Pusher::poll, nb::arg("now") = -1.0)
        .def("wait", &Pusher::wait, nb::arg("timeout_s"), nb::arg("fds"), nb::arg("doorbell"), nb::arg("worker_fd"),
             nb::arg("idle"), nb::arg("spin_s"), nb::arg("eager"))
        .def("take_words", &Pusher::take_words)
        .def("take_finished", &Pusher::take_finished)
        .def("close", &Pusher::close)
        .def("pending", &Pusher::pending)
        .def("settled", &Pusher::settled, nb::arg("handle"), nb::arg("eid"))
        .def("stats", &Pusher::stats)
        .def_prop_ro("in_flight", &Pusher::in_flight);
}
