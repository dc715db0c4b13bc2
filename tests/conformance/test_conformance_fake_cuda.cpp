// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The mismatch checks of the device communicators on a fake CUDA runtime and a fake NCCL, so that
// they are tested on every machine, not only where a GPU is: the conformance kit's mismatch rows on
// the shared-GPU communicator (tests/conformance/test_conformance_device.cpp runs the same rows on
// a GPU), and the NCCL communicator's default-on, batched check (issue 40 §3) on 2 fake ranks.
//
// The fake: this executable defines the CUDA runtime and NCCL functions that the device
// communicators and the kit's device buffers call (cuda_buffers.hpp), so the linker binds them
// here rather than to libcudart and libnccl (which stay linked for the rest). "Device memory" is
// host memory that the fake knows (so cudaPointerGetAttributes can tell it from a host pointer).
// A stream runs its work in order, each piece as soon as the work before it is done: copies and
// sets at once on an idle stream (the shared-GPU communicator's streams always are: every
// participant's work lies between two host rendezvous), a fake NCCL collective once every rank's
// stream has reached it with a share of the same size, never when the sizes differ (NCCL hangs);
// an event completes when its stream reaches its latest record. The reduction kernel (NVRTC) is not faked: the rows that matter here
// fail before any data moves, which is the point of the check.
#include <cuda_runtime_api.h>

#include <meshlib/nccl.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "conformance.hpp"
#include "cuda_buffers.hpp"
#include "meshlib_catch.hpp"

// A stream runs its work in order: each piece of work is a closure that returns true once done
// (a copy at once; a fake NCCL collective when every rank has posted its share). Every enqueue and
// every event query moves the stream on as far as it can, so a collective that never completes
// (ranks that disagree on its size, as NCCL hangs) holds back everything behind it.
struct CUstream_st {
  std::deque<std::function<bool()>> work;
  void progress() {
    while (!work.empty() && work.front()()) work.pop_front();
  }
  void enqueue(std::function<bool()> w) {
    work.push_back(std::move(w));
    progress();
  }
};
struct CUevent_st {
  bool done = true;
  CUstream_st* stream = nullptr;
  std::uint64_t record = 0;  ///< as in CUDA, a query sees the latest record only
};

namespace fake {

/// The allocations the fake knows, by start address (so an interior pointer is found too).
struct memory {
  std::mutex m;
  std::map<const char*, std::size_t> blocks;
  int bad_frees = 0;
  int live_events = 0;

  void* allocate(std::size_t bytes) {
    char* p = static_cast<char*>(std::malloc(bytes == 0 ? 1 : bytes));
    std::lock_guard g(m);
    blocks[p] = bytes;
    return p;
  }
  cudaError_t release(void* p) {
    if (p == nullptr) return cudaSuccess;
    std::lock_guard g(m);
    auto it = blocks.find(static_cast<const char*>(p));
    if (it == blocks.end()) {
      ++bad_frees;  // a double free or a free of the caller's memory: what the fake exists to catch
      return cudaErrorInvalidValue;
    }
    blocks.erase(it);
    std::free(p);
    return cudaSuccess;
  }
  bool knows(const void* p) {
    std::lock_guard g(m);
    const auto* c = static_cast<const char*>(p);
    auto it = blocks.upper_bound(c);
    if (it == blocks.begin()) return false;
    --it;
    return c < it->first + (it->second == 0 ? 1 : it->second);
  }
};
memory& mem() {
  static memory m;
  return m;
}
thread_local int current_device = 0;

}  // namespace fake

extern "C" {
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 2;  // the NCCL tests below run one rank per fake GPU
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = fake::current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device > 1) return cudaErrorInvalidDevice;
  fake::current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorFake"; }
const char* cudaGetErrorString(cudaError_t) { return "an error of the fake CUDA runtime"; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  *s = new CUstream_st{};
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (s != nullptr) s->progress();
  return s == nullptr || s->work.empty() ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = new CUevent_st{};
  std::lock_guard g(fake::mem().m);
  ++fake::mem().live_events;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (s == nullptr) return cudaSuccess;  // the legacy stream: nothing runs on it here
  e->done = false;
  e->stream = s;
  const std::uint64_t mine = ++e->record;
  s->enqueue([e, mine] {
    if (e->record == mine) e->done = true;  // an earlier record of a reused event completes nothing
    return true;
  });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e->done && e->stream != nullptr) e->stream->progress();
  return e->done ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  std::lock_guard g(fake::mem().m);
  --fake::mem().live_events;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = fake::mem().allocate(bytes);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) { return fake::mem().release(p); }
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return fake::mem().release(p); }
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  *p = std::malloc(bytes == 0 ? 1 : bytes);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* to, const void* from, size_t bytes, enum cudaMemcpyKind, cudaStream_t s) {
  auto w = [=] {
    if (bytes != 0) std::memmove(to, from, bytes);
    return true;
  };
  if (s == nullptr) w();
  else s->enqueue(w);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  auto w = [=] {
    if (bytes != 0) std::memset(p, value, bytes);
    return true;
  };
  if (s == nullptr) w();
  else s->enqueue(w);
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* a, const void* p) {
  *a = cudaPointerAttributes{};
  a->type = fake::mem().knows(p) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  a->device = 0;
  return cudaSuccess;
}
}  // extern "C"

// ---- a fake NCCL: ranks of one process (threads), collectives that complete when every rank has
// posted its share of the same size, and never when the sizes differ (as NCCL hangs) -------------

namespace fake {
struct nccl_group {
  struct share {
    std::size_t bytes = 0;
    const void* send = nullptr;
    void* recv = nullptr;
    bool gather = false;
  };
  struct slot {
    std::vector<share> shares;
    int posted = 0;
    bool executed = false;
  };
  std::mutex m;
  int n = 0;
  std::map<std::uint64_t, slot> slots;

  /// Rank `r`'s share of collective `seq`: true once it has run (all-gather: every rank's send
  /// lands in every recv; all-reduce: nothing moves, the values are not what these tests check).
  bool try_complete(std::uint64_t seq) {
    std::lock_guard g(m);
    auto& sl = slots[seq];
    if (sl.executed) return true;
    if (sl.posted < n) return false;
    for (const auto& sh : sl.shares)
      if (sh.bytes != sl.shares[0].bytes || sh.gather != sl.shares[0].gather) return false;  // hangs
    for (const auto& to : sl.shares)
      if (to.gather)
        for (std::size_t q = 0; q < sl.shares.size(); ++q)
          std::memcpy(static_cast<char*>(to.recv) + q * sl.shares[q].bytes, sl.shares[q].send, sl.shares[q].bytes);
    sl.executed = true;
    return true;
  }
};
}  // namespace fake

struct ncclComm {
  fake::nccl_group* group = nullptr;
  int rank = 0;
  std::uint64_t seq = 0;
  std::atomic<bool> aborted{false};
};

namespace fake {
/// A rank's share joins the collective when its stream reaches it (the work before it, such as
/// the copy of the check's fingerprints to the device, has run by then), not when it is enqueued.
ncclResult_t post(ncclComm_t c, nccl_group::share sh, cudaStream_t s) {
  const std::uint64_t seq = c->seq++;
  s->enqueue([grp = c->group, rank = c->rank, seq, sh, joined = false]() mutable {
    if (!joined) {
      joined = true;
      std::lock_guard g(grp->m);
      auto& sl = grp->slots[seq];
      sl.shares.resize(static_cast<std::size_t>(grp->n));
      sl.shares[static_cast<std::size_t>(rank)] = sh;
      ++sl.posted;
    }
    return grp->try_complete(seq);
  });
  return ncclSuccess;
}
}  // namespace fake

extern "C" {
ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t t, ncclComm_t c, cudaStream_t s) {
  const std::size_t bytes = count * (t == ncclInt64 || t == ncclFloat64 || t == ncclUint64 ? 8 : 4);
  return fake::post(c, {bytes, send, recv, true}, s);
}
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t, ncclComm_t c,
                           cudaStream_t s) {
  const std::size_t bytes = count * (t == ncclInt64 || t == ncclFloat64 || t == ncclUint64 ? 8 : 4);
  return fake::post(c, {bytes, send, recv, false}, s);
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t* async) {
  *async = ncclSuccess;
  return ncclSuccess;
}
const char* ncclGetLastError(ncclComm_t) { return ""; }
ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
ncclResult_t ncclCommDestroy(ncclComm_t c) {
  delete c;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t c) {
  c->aborted.store(true);
  return ncclSuccess;
}
}  // extern "C"

namespace {

using clk = std::chrono::steady_clock;
namespace ml = meshlib;

/// Runs `body` on `n` shared-GPU devices of the fake GPU and records what each one saw.
std::vector<conformance::outcome> run_devices(int n, const std::function<void(ml::shared_gpu_communicator&)>& body) {
  std::vector<conformance::outcome> seen(static_cast<std::size_t>(n));
  const auto t0 = clk::now();
  try {
    ml::run_on_shared_gpu(
        n,
        [&](ml::shared_gpu_communicator& c) {
          auto& mine = seen[static_cast<std::size_t>(c.rank())];
          try {
            body(c);
            mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
          } catch (...) {
            mine = conformance::classify(std::current_exception());
            mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
            throw;
          }
        },
        {.device = 0});
  } catch (const ml::participant_error&) {
  }
  return seen;
}

}  // namespace

TEST_CASE("fake CUDA: the fake knows its memory and frees each block once", "[conformance][shared_gpu][fake]") {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 16) == cudaSuccess);
  CHECK(fake::mem().knows(static_cast<char*>(p) + 15));
  int host = 0;
  CHECK_FALSE(fake::mem().knows(&host));
  CHECK(cudaFree(p) == cudaSuccess);
  const int before = fake::mem().bad_frees;
  CHECK(cudaFree(p) == cudaErrorInvalidValue);
  CHECK(fake::mem().bad_frees == before + 1);
}

// The kit's own table (conformance.hpp): the same rows, words and bounds as on the GPU.
TEST_CASE("shared GPU on a fake CUDA runtime: the conformance mismatch rows, 2 and 4 devices",
          "[conformance][shared_gpu][fake]") {
  using comm = ml::shared_gpu_communicator;
  const int bad_frees = fake::mem().bad_frees;
  for (int n : {2, 4})
    for (const auto& row : conformance::mismatch_rows<comm, conformance::cuda_buffers>()) {
      const auto seen = run_devices(n, row.body);
      for (int r = 0; r < n; ++r) {
        INFO(row.name << ", " << n << " fake shared-GPU devices, device " << r);
        CHECK(row.check(r, n, seen[static_cast<std::size_t>(r)]) == "");
      }
    }
  CHECK(fake::mem().bad_frees == bad_frees);
}

// Issue 40 §3: two devices that call all_reduce with different counts do not hang: each gets
// collective_mismatch naming both devices and both calls, before anything moves.
TEST_CASE("shared GPU on a fake CUDA runtime: all_reduce of 8 and of 4 floats names both devices and calls",
          "[conformance][shared_gpu][fake]") {
  const auto seen = run_devices(2, [](ml::shared_gpu_communicator& c) {
    auto x = conformance::cuda_buffers::make(c, std::vector<float>(c.rank() == 0 ? 8 : 4, 1.0f));
    c.all_reduce(x.span(), ml::reduce_op::sum);
  });
  for (int r = 0; r < 2; ++r) {
    INFO("device " << r);
    const auto& o = seen[static_cast<std::size_t>(r)];
    CHECK(o.type == "mismatch");
    CHECK(o.what == "meshlib: collective mismatch on the devices of GPU 0 (seen by device " + std::to_string(r) +
                        "): device 0 called all_reduce(float32, count 8, op sum); device 1 called all_reduce(float32, "
                        "count 4, op sum)");
    CHECK(o.seconds < conformance::prompt_s);
  }
}

// The fake itself moves data as the GPU would, so agreeing calls complete with the right values
// (a fake that failed every call would pass the mismatch rows for the wrong reason).
TEST_CASE("shared GPU on a fake CUDA runtime: agreeing broadcast and all_gather move the data", "[conformance][shared_gpu][fake]") {
  const auto seen = run_devices(3, [](ml::shared_gpu_communicator& c) {
    auto b = conformance::cuda_buffers::make(c, std::vector<int>(5, c.rank() == 1 ? 7 : 0));
    c.broadcast(b.span(), 1).wait();
    if (b.get() != std::vector<int>(5, 7)) throw std::runtime_error("broadcast: wrong values");
    auto mine = conformance::cuda_buffers::make(c, std::vector<int>(2, c.rank() + 1));
    auto all = conformance::cuda_buffers::make(c, std::vector<int>(6, 0));
    c.all_gather(mine.cspan(), all.span()).wait();
    if (all.get() != std::vector<int>{1, 1, 2, 2, 3, 3}) throw std::runtime_error("all_gather: wrong values");
  });
  for (const auto& o : seen) CHECK(o.type == "");
}

// ---- the NCCL communicator's default-on, batched check on the fake NCCL (issue 40 §3) -----------

namespace {

/// Runs `body(communicator)` on 2 fake NCCL ranks (threads, fake GPUs 0 and 1) with `o`, and
/// records what each one saw.
std::vector<conformance::outcome> run_nccl(const ml::nccl_comm_options& o,
                                           const std::function<void(ml::nccl_communicator&)>& body) {
  constexpr int n = 2;
  fake::nccl_group group;
  group.n = n;
  std::vector<conformance::outcome> seen(n);
  std::vector<std::thread> threads;
  const auto t0 = clk::now();
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto& mine = seen[static_cast<std::size_t>(r)];
      cudaStream_t stream = nullptr;
      (void)cudaStreamCreateWithFlags(&stream, 0);
      {
        auto st = std::make_shared<ml::detail::nccl_comm_state>();
        st->options = o;
        st->options.check_pointers = false;
        st->batch = ml::detail::call_batch(o.verify_every, o.verify_each_first);
        st->rank = r;
        st->size = n;
        st->device = r;
        st->stream = stream;
        st->comm = new ncclComm{&group, r};
        ml::nccl_communicator c(std::move(st));
        try {
          body(c);
        } catch (...) {
          mine = conformance::classify(std::current_exception());
        }
        mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
        // A failed communicator is aborted, not destroyed: its fake comm is freed here.
        if (c.failed()) delete c.native();
      }
      (void)cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  return seen;
}

/// The rows that end by a mismatch or succeed run with the kit's long timeout (20 s), so that a
/// loaded machine that starts one rank's thread late cannot turn them into a timeout (issue 40 §5).
ml::nccl_comm_options long_timeout() {
  ml::nccl_comm_options o;
  o.timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(conformance::fault_timeout_s));
  return o;
}
/// The row whose verdict is the timeout itself: 2 s, a margin for the ranks' start on a loaded
/// machine (they meet at the first call, checked on its own, before the hang at call 66).
ml::nccl_comm_options hang_timeout() {
  ml::nccl_comm_options o;
  o.timeout = std::chrono::seconds(2);
  return o;
}

}  // namespace

TEST_CASE("nccl on a fake NCCL: ranks that disagree on an all_reduce's count get collective_mismatch naming the call, "
          "by default, instead of a hang",
          "[nccl][fake]") {
  const auto seen = run_nccl(long_timeout(), [](ml::nccl_communicator& c) {
    auto x = conformance::cuda_buffers::make(c, std::vector<float>(c.rank() == 0 ? 8 : 4, 1.0f));
    c.all_reduce(x.span(), ml::reduce_op::sum).wait();
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const auto& o = seen[static_cast<std::size_t>(r)];
    CHECK(o.type == "mismatch");
    CHECK(o.what == "meshlib: collective mismatch in collective 1 on this communicator (seen by NCCL rank " +
                        std::to_string(r) + " of 2, GPU " + std::to_string(r) +
                        "): rank 0 called all_reduce(float32, count 8, op sum); rank 1 called all_reduce(float32, "
                        "count 4, op sum)");
    CHECK(o.seconds < conformance::prompt_s);  // a backstop: the type says the check released it, not the timeout
  }
}

TEST_CASE("nccl on a fake NCCL: after the first calls, a batch names the exact call on which the ranks disagree",
          "[nccl][fake]") {
  // Calls 1..64 are each checked; 65..80 form one batch, checked before call 80's data moves. Call
  // 70 differs in its reduce op (sizes agree, so NCCL would not hang: it would sum on one rank and
  // take the max on the other); the check names it, and every call before it agreed.
  const auto seen = run_nccl(long_timeout(), [](ml::nccl_communicator& c) {
    auto x = conformance::cuda_buffers::make(c, std::vector<float>(2, 1.0f));
    for (int call = 1; call <= 80; ++call) {
      const auto op = call == 70 && c.rank() == 1 ? ml::reduce_op::max : ml::reduce_op::sum;
      auto r = c.all_reduce(x.span(), op);
      if (call % 8 == 0) r.wait();
    }
    c.barrier();  // not reached: call 80's wait (above) throws
  });
  for (int r = 0; r < 2; ++r) {
    const auto& o = seen[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << o.what);
    CHECK(o.type == "mismatch");
    CHECK(o.what.find("collective mismatch in collective 70 on this communicator") != std::string::npos);
    CHECK(o.what.find("rank 0 called all_reduce(float32, count 2, op sum); rank 1 called all_reduce(float32, count "
                      "2, op max)") != std::string::npos);
  }
}

TEST_CASE("nccl on a fake NCCL: a count disagreement inside a batch hangs NCCL; the timeout lists each rank's unchecked calls",
          "[nccl][fake]") {
  const auto seen = run_nccl(hang_timeout(), [](ml::nccl_communicator& c) {
    auto x = conformance::cuda_buffers::make(c, std::vector<float>(8, 1.0f));
    for (int call = 1; call <= 66; ++call) {
      const std::size_t count = call == 66 && c.rank() == 1 ? 4 : 8;
      c.all_reduce(x.span().first(count), ml::reduce_op::sum).wait();
    }
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const auto& o = seen[static_cast<std::size_t>(r)];
    CHECK(o.type == "timeout");
    const std::string mine = r == 1 ? "count 4" : "count 8";
    CHECK(o.what.ends_with("the collectives this rank made since its last mismatch check: 65 all_reduce(float32, "
                           "count 8, op sum), 66 all_reduce(float32, " + mine + ", op sum)"));
  }
}

TEST_CASE("nccl on a fake NCCL: agreeing calls pass the check, with it on or off", "[nccl][fake]") {
  for (bool on : {true, false}) {
    ml::nccl_comm_options o = long_timeout();
    o.verify_collectives = on;
    const auto seen = run_nccl(o, [](ml::nccl_communicator& c) {
      auto x = conformance::cuda_buffers::make(c, std::vector<float>(3, 1.0f));
      for (int call = 1; call <= 100; ++call) c.all_reduce(x.span(), ml::reduce_op::sum).wait();
    });
    for (const auto& s : seen) CHECK(s.type == "");
  }
}
