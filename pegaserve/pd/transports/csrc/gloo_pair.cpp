// A gloo pair's handoff with no Python between a fetch and its bytes (pd/transports/native.py builds
// and loads it; pd/pair_channel.py holds the same protocol in Python, which runs where this cannot).
//
// Decode (`pull`) sends the fetch, then posts a receive per slab straight into its cache and one for
// the verdict (gloo holds a send until its receive is posted, so the order is free: the fetch goes
// first, for prefill's thread to wake while decode posts); prefill (`serve_fetch`, a thread of its
// own per pair) waits for the fetch, sends the slabs it names straight from its cache, checks the
// blocks' generations once they are read, and sends its verdict. The fetch is int64 words that both
// sides read, then the pickled request id and choice ids, which only prefill's bookkeeping reads,
// after the verdict is on its way.
//
// The header's words (pair_channel.fetch_message writes them): [0] the message's length in bytes,
// [1] runs (-1: the blocks travel packed, which the Python side does), [2] blocks, [3] the lease's
// expiry (a double: CLOCK_MONOTONIC seconds, Python's time.monotonic()); then per run (source
// block, target block, blocks), then the source ids, the target ids, and the generations the source
// blocks parked with.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

namespace {

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;
constexpr int64_t kHeaderWords = 4;
const auto kForever = std::chrono::milliseconds(365LL * 24 * 3600 * 1000);  // a pair idles between prompts

// The cache viewed as [layers * 2, blocks, block elements]: one slab is a run of one layer's K or V.
at::Tensor slabs_of(const at::Tensor& cache) {
  TORCH_CHECK(cache.dim() >= 3 && cache.is_contiguous(), "the KV cache must be contiguous, [layers, 2, blocks, ...]");
  return cache.view({cache.size(0) * cache.size(1), cache.size(2), -1});
}

// Per run, per layer, K then V: the run's blocks (side 0: source ids, 1: target ids), as
// pair_channel._slabs cuts them, so the tags match the Python side's.
std::vector<at::Tensor> cut(const at::Tensor& cache, const int64_t* runs, int64_t num_runs, int side) {
  const at::Tensor flat = slabs_of(cache);
  const int64_t num_blocks = flat.size(1);
  std::vector<at::Tensor> slabs;
  slabs.reserve(num_runs * flat.size(0));
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t first = runs[3 * r + side], width = runs[3 * r + 2];
    TORCH_CHECK(first >= 0 && width > 0 && first + width <= num_blocks, "a run past the cache's blocks");
    for (int64_t s = 0; s < flat.size(0); ++s) slabs.push_back(flat.select(0, s).narrow(0, first, width));
  }
  return slabs;
}

c10::intrusive_ptr<c10d::Work> post(const c10::intrusive_ptr<c10d::Backend>& pair, bool send, at::Tensor tensor,
                                    int64_t peer, int64_t tag) {
  std::vector<at::Tensor> one{std::move(tensor)};
  return send ? pair->send(one, peer, tag) : pair->recv(one, peer, tag);
}

void wait_all(const Works& works) {
  for (const auto& work : works) work->wait();
}

double monotonic_s() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// Decode's pending transfer: its receives (the slabs', then the verdict's) and the fetch's send.
struct Pull {
  Works works;
  at::Tensor flag;

  // Blocks until every slab and the verdict have arrived; returns the verdict.
  bool wait() {
    {
      pybind11::gil_scoped_release nogil;
      wait_all(works);
    }
    works.clear();
    return flag.item<int32_t>() != 0;
  }
};

Pull pull(const c10::intrusive_ptr<c10d::Backend>& pair, const at::Tensor& cache, const at::Tensor& fetch,
          at::Tensor flag, int64_t peer, int64_t verdict_tag, int64_t fetch_tag) {
  TORCH_CHECK(fetch.dtype() == at::kByte && fetch.is_contiguous() && fetch.numel() >= 8 * kHeaderWords,
              "a fetch is a contiguous uint8 message with a header");
  const auto* words = fetch.data_ptr<uint8_t>();
  int64_t header[kHeaderWords];
  std::memcpy(header, words, sizeof header);
  TORCH_CHECK(header[1] >= 0 && 8 * (kHeaderWords + 3 * header[1]) <= fetch.numel(), "a fetch without its runs");
  std::vector<int64_t> runs(3 * header[1]);
  std::memcpy(runs.data(), words + 8 * kHeaderWords, 8 * runs.size());
  Pull pending{{}, flag};
  pybind11::gil_scoped_release nogil;
  const auto slabs = cut(cache, runs.data(), header[1], 1);
  pending.works.reserve(slabs.size() + 2);
  pending.works.push_back(post(pair, true, fetch, peer, fetch_tag));  // first: prefill wakes while we post
  for (size_t tag = 0; tag < slabs.size(); ++tag) pending.works.push_back(post(pair, false, slabs[tag], peer, tag));
  pending.works.push_back(post(pair, false, flag, peer, verdict_tag));
  return pending;
}

// What `serve_fetch` did: `sent` (whether it sent the blocks: packed ones are left to the Python
// side), the verdict it sent, and the seconds from the fetch's arrival to the verdict's send.
struct Served {
  bool sent;
  bool held;
  double seconds;
};

Served serve_fetch(const c10::intrusive_ptr<c10d::Backend>& pair, const at::Tensor& cache,
                   const at::Tensor& generations, at::Tensor buffer, at::Tensor flag, int64_t peer,
                   int64_t verdict_tag, int64_t fetch_tag, double delay_s) {
  TORCH_CHECK(buffer.dtype() == at::kByte && buffer.is_contiguous(), "the fetch buffer is contiguous uint8");
  TORCH_CHECK(generations.dtype() == at::kLong && generations.is_contiguous(), "generations are contiguous int64");
  pybind11::gil_scoped_release nogil;
  post(pair, false, buffer, peer, fetch_tag)->wait(kForever);  // raises once the peer closed the pair
  const double start = monotonic_s();
  const auto* bytes = buffer.data_ptr<uint8_t>();
  int64_t header[kHeaderWords];
  std::memcpy(header, bytes, sizeof header);
  const int64_t length = header[0], num_runs = header[1], num_blocks = header[2];
  double held_until;
  std::memcpy(&held_until, &header[3], sizeof held_until);
  TORCH_CHECK(num_runs <= length && num_blocks >= 0 && num_blocks <= length && length <= buffer.numel() &&
              8 * (kHeaderWords + 3 * std::max<int64_t>(num_runs, 0) + 3 * num_blocks) <= length, "a malformed fetch");
  if (num_runs < 0) return {false, false, 0.0};
  std::vector<int64_t> words(3 * num_runs + 3 * num_blocks);
  std::memcpy(words.data(), bytes + 8 * kHeaderWords, 8 * words.size());
  if (delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
  const auto slabs = cut(cache, words.data(), num_runs, 0);
  Works sends;
  sends.reserve(slabs.size());
  for (size_t tag = 0; tag < slabs.size(); ++tag) sends.push_back(post(pair, true, slabs[tag], peer, tag));
  wait_all(sends);
  // The reads are over: they were the prompt's if the lease still held and no block was handed out anew.
  bool held = monotonic_s() < held_until;
  const auto* live = generations.data_ptr<int64_t>();
  const int64_t* sources = words.data() + 3 * num_runs;
  const int64_t* parked = sources + 2 * num_blocks;
  for (int64_t i = 0; held && i < num_blocks; ++i) {
    const int64_t block = sources[i], expected = parked[i];
    held = block >= 0 && block < generations.numel() && __atomic_load_n(live + block, __ATOMIC_ACQUIRE) == expected;
  }
  flag.fill_(held ? 1 : 0);
  post(pair, true, flag, peer, verdict_tag)->wait();
  return {true, held, monotonic_s() - start};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Pull>(m, "Pull").def("wait", &Pull::wait);
  pybind11::class_<Served>(m, "Served")
      .def_readonly("sent", &Served::sent)
      .def_readonly("held", &Served::held)
      .def_readonly("seconds", &Served::seconds);
  m.def("pull", &pull);
  m.def("serve_fetch", &serve_fetch);
  m.attr("HEADER_WORDS") = kHeaderWords;
}
