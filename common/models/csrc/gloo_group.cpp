// A drafter group's collectives on CPU: PyTorch's own Gloo process group
// (c10d::ProcessGroupGloo, compiled into libtorch_cpu) over its TCPStore
// rendezvous, which tch does not expose. Rank 0 serves the store; every
// member connects to it, and Gloo then connects the members pairwise over
// TCP. The store also carries small values between members (the NCCL unique
// id of a GPU group). Every call catches libtorch's exceptions and returns
// them as text: a member that died shows up here as an error, not a hang
// (the process group's timeout bounds every collective).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {
void fail(char* err, int err_len, const std::exception& e) { snprintf(err, err_len, "%s", e.what()); }
}  // namespace

struct DflashGroup {
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

// Rank 0 serves the group's store on `host`:`port` (0: any free port;
// `dflash_group_store_port` tells the port bound) for `world` members; the
// other ranks connect to it there.
extern "C" DflashGroup* dflash_group_open_store(const char* host, int port, bool serve, int world,
                                                int64_t timeout_ms, char* err, int err_len) {
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = serve;
    if (serve) o.numWorkers = static_cast<std::size_t>(world);
    o.waitWorkers = false;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    auto g = new DflashGroup();
    g->tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), o);
    return g;
  } catch (const std::exception& e) {
    fail(err, err_len, e);
    return nullptr;
  }
}

extern "C" int dflash_group_store_port(DflashGroup* g) { return g->tcp->getPort(); }

// Forms the Gloo group of `world` members under `prefix` (the group's
// generation: a later generation never meets an earlier one's keys). Gloo
// listens on the interface of `own_host`. Collective (every rank calls it).
extern "C" int dflash_group_init_gloo(DflashGroup* g, const char* prefix, const char* own_host, int rank, int world,
                                      int64_t timeout_ms, char* err, int err_len) {
  try {
    g->store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), g->tcp);
    auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(timeout_ms));
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(std::string(own_host)));
    g->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(g->store, rank, world, opts);
    return 0;
  } catch (const std::exception& e) {
    fail(err, err_len, e);
    return 1;
  }
}

// In place over the group: op 0 sum, 1 min, 2 max. Waits for the result.
extern "C" int dflash_group_all_reduce(DflashGroup* g, at::Tensor* t, int op, char* err, int err_len) {
  try {
    std::vector<at::Tensor> ts{*t};
    c10d::AllreduceOptions o;
    o.reduceOp = op == 1 ? c10d::ReduceOp::MIN : op == 2 ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    g->pg->allreduce(ts, o)->wait();
    return 0;
  } catch (const std::exception& e) {
    fail(err, err_len, e);
    return 1;
  }
}

// A small value for the other members, under the group's prefix.
extern "C" int dflash_group_store_set(DflashGroup* g, const char* prefix, const char* key, const uint8_t* data,
                                      size_t len, char* err, int err_len) {
  try {
    std::vector<uint8_t> v(data, data + len);
    g->tcp->set(std::string(prefix) + "/" + key, v);
    return 0;
  } catch (const std::exception& e) {
    fail(err, err_len, e);
    return 1;
  }
}

// Adds `delta` to the counter `key` under the group's prefix and tells its
// new value (delta 0 reads it); never waits for another member.
extern "C" int dflash_group_store_add(DflashGroup* g, const char* prefix, const char* key, int64_t delta,
                                      int64_t* value, char* err, int err_len) {
  try {
    *value = g->tcp->add(std::string(prefix) + "/" + key, delta);
    return 0;
  } catch (const std::exception& e) {
    fail(err, err_len, e);
    return 1;
  }
}

// Waits (up to the store's timeout) for a value another member set;
// copies at most `cap` bytes and tells the full length.
extern "C" int dflash_group_store_get(DflashGroup* g, const char* prefix, const char* key, uint8_t* out, size_t cap,
                                      size_t* len, char* err, int err_len) {
  try {
    auto v = g->tcp->get(std::string(prefix) + "/" + key);
    *len = v.size();
    std::memcpy(out, v.data(), std::min(cap, v.size()));
    return 0;
  } catch (const std::exception& e) {
    fail(err, err_len, e);
    return 1;
  }
}

extern "C" void dflash_group_free(DflashGroup* g) { delete g; }
