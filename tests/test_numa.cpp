// SPDX-License-Identifier: Apache-2.0
// NUMA placement of the pinned load region (numa.hpp, docs/MULTI-GPU.md):
//   * the kernel node-list parser and its inverse on sample strings;
//   * mlock_allocator with a node: its pages report MPOL_BIND on that node
//     (get_mempolicy), without one the default policy; a node that is not
//     online is refused with config_error naming the node and the online list,
//     with nothing mapped; numa_bind's own refusals;
//   * a cache whose pinned region is bound to a node decodes bit-identically
//     to the same cache without a node, and its region reports the binding;
//   * tensor_parallel: the rule that gives each rank's allocator its device's
//     node (tp_rank_allocator), and a caller's node kept on every rank;
//   * pci_device_numa_node against the host's sysfs.
// mlock under a small RLIMIT_MEMLOCK (a non-root run): a refusal of mlock
// itself skips the case with a message, as the mlock cases of test_cache do;
// a kernel or sandbox without the NUMA system calls (mbind refused with ENOSYS
// or EPERM) skips the cases that need them, with a message.
#include <doctest/doctest.h>

#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <string>
#include <vector>

#include <writescope/numa.hpp>
#include <writescope/tensor_parallel.hpp>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

/// The first online node (node 0 on almost every host).
int first_node() { return numa_online_nodes().front(); }

/// Whether mbind and get_mempolicy work here; otherwise `why` says what refused them.
bool numa_calls_available(std::string& why) {
  const long page = ::sysconf(_SC_PAGESIZE);
  void* p = ::mmap(nullptr, std::size_t(page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(p != MAP_FAILED);
  bool ok = true;
  try {
    numa_bind(p, page, first_node());
    (void)numa_page_policy(p);
  } catch (const resource_error& e) {
    why = e.what();
    ok = false;
  }
  ::munmap(p, std::size_t(page));
  return ok;
}

/// allocate(bytes), or an empty allocation (with a message) when mlock itself
/// is refused (RLIMIT_MEMLOCK); every other refusal propagates.
template <class A>
host_allocation allocate_or_skip(const A& a, index_t bytes) {
  try {
    return a.allocate(bytes);
  } catch (const pinned_memory_error& e) {
    const std::string what = e.what();
    if (what.find("with mlock failed") == std::string::npos) throw;
    MESSAGE("skipped: mlock refused here (" << what << ")");
    return {};
  }
}

/// VmSize of /proc/self/status in bytes.
index_t vm_size() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmSize:", 0) == 0) return index_t(std::atol(line.c_str() + 7)) * 1024;
  return -1;
}

partition_spec cache_spec() {
  partition_spec s = small_spec_for(G(4, 2), 1, 1);
  s.cpu_capacity_tokens = 4 * 32;
  s.pinned_capacity_tokens = 4 * 32;
  s.pinned_initial_tokens = -1;  // the whole pinned region at init
  return s;
}

}  // namespace

TEST_CASE("parse_numa_node_list / format_numa_node_list: the kernel's node-list form") {
  CHECK(parse_numa_node_list("0") == std::vector<int>{0});
  CHECK(parse_numa_node_list("0\n") == std::vector<int>{0});
  CHECK(parse_numa_node_list("0-1") == std::vector<int>{0, 1});
  CHECK(parse_numa_node_list("0,2-3") == std::vector<int>{0, 2, 3});
  CHECK(parse_numa_node_list("2-3,0\n") == std::vector<int>{0, 2, 3});
  CHECK(parse_numa_node_list("0-3,2") == std::vector<int>{0, 1, 2, 3});
  CHECK(parse_numa_node_list("").empty());
  CHECK(parse_numa_node_list(" \n").empty());
  for (const char* bad : {"a", "0-", "-1", "0,,1", "3-1", "0-1x", "4096"}) {
    CAPTURE(bad);
    try {
      (void)parse_numa_node_list(bad);
      FAIL("accepted");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"node list", std::string("\"") + bad + "\""}));
    }
  }
  CHECK(format_numa_node_list(std::vector<int>{0}) == "0");
  CHECK(format_numa_node_list(std::vector<int>{0, 1}) == "0-1");
  CHECK(format_numa_node_list(std::vector<int>{0, 2, 3}) == "0,2-3");
  CHECK(format_numa_node_list(std::vector<int>{0, 2, 4, 5, 6}) == "0,2,4-6");
  CHECK(format_numa_node_list(std::vector<int>{}).empty());

  const std::vector<int> online = numa_online_nodes();
  REQUIRE(!online.empty());
  CHECK(std::is_sorted(online.begin(), online.end()));
  std::ifstream in("/sys/devices/system/node/online");
  if (in) {
    std::string text;
    std::getline(in, text);
    CHECK(online == parse_numa_node_list(text));
    CHECK(parse_numa_node_list(format_numa_node_list(online)) == online);
  } else {
    CHECK(online == std::vector<int>{0});
  }
}

TEST_CASE("mlock_allocator with a node: its pages are bound (MPOL_BIND) to the node; without one, the default policy") {
  std::string why;
  if (!numa_calls_available(why)) {
    MESSAGE("skipped: the NUMA system calls are refused here (" << why << ")");
    return;
  }
  const int node = first_node();
  const index_t bytes = (index_t{1} << 20) + 100;  // not a whole number of pages
  const long page = ::sysconf(_SC_PAGESIZE);
  {
    host_allocation a = allocate_or_skip(mlock_allocator{node}, bytes);
    if (!a) return;
    CHECK(a.size_bytes() == bytes);
    for (index_t off : {index_t{0}, index_t(page), bytes / 2, bytes - 1}) {
      CAPTURE(off);
      const numa_page_info info = numa_page_policy(a.data() + off);
      CHECK(info.mode == MPOL_BIND);
      CHECK(info.nodes == std::vector<int>{node});
      CHECK(info.node == node);
    }
  }
  {
    host_allocation a = allocate_or_skip(mlock_allocator{}, bytes);
    if (!a) return;
    for (index_t off : {index_t{0}, bytes - 1}) {
      CAPTURE(off);
      const numa_page_info info = numa_page_policy(a.data() + off);
      CHECK(info.mode == MPOL_DEFAULT);
      CHECK(info.nodes.empty());
      CHECK(info.node >= 0);
    }
  }
}

TEST_CASE("a node that is not online is refused with config_error naming the node and the online nodes; nothing mapped") {
  const std::vector<int> online = numa_online_nodes();
  const int absent = online.back() + 1;
  const std::string listed = format_numa_node_list(online);
  auto refusal = [&](auto&& f) -> std::string {
    try {
      f();
    } catch (const config_error& e) {
      return e.what();
    }
    return {};
  };
  (void)refusal([&] { (void)mlock_allocator{absent}.allocate(1 << 20); });  // the first exception's allocations
  const index_t size0 = vm_size();
  const std::string what = refusal([&] { (void)mlock_allocator{absent}.allocate(1 << 20); });
  const index_t size1 = vm_size();
  REQUIRE(!what.empty());
  CHECK(mentions(what, {"mlock_allocator", "NUMA node " + std::to_string(absent), "online nodes: " + listed}));
  CHECK(size1 == size0);

  // A cache built with it refuses at init, naming the same.
  host_backend be;
  const std::string cache_what = refusal([&] {
    inplace_kv_cache<G, host_backend, mlock_allocator, gpu_only> cache(be, G(4, 2), cache_spec(), gpu_only{},
                                                                       mlock_allocator{absent});
  });
  CHECK(mentions(cache_what, {"NUMA node " + std::to_string(absent), "online nodes: " + listed}));

  // numa_bind itself: a node not online, a range not on a page boundary; the policy stays the default.
  const long page = ::sysconf(_SC_PAGESIZE);
  void* p = ::mmap(nullptr, std::size_t(2 * page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(p != MAP_FAILED);
  const std::string bind_what = refusal([&] { numa_bind(p, page, absent); });
  CHECK(mentions(bind_what, {"numa_bind", "NUMA node " + std::to_string(absent), "online nodes: " + listed}));
  try {
    numa_bind(static_cast<char*>(p) + 8, page, online.front());
    FAIL("an unaligned range was bound");
  } catch (const shape_error& e) {
    CHECK(mentions(e.what(), {"page boundary", "offset 8"}));
  }
  std::string why;
  if (numa_calls_available(why)) CHECK(numa_page_policy(p).mode == MPOL_DEFAULT);
  ::munmap(p, std::size_t(2 * page));
}

TEST_CASE("a cache whose pinned region is bound to a node decodes bit-identically to one without, its region bound") {
  std::string why;
  if (!numa_calls_available(why)) {
    MESSAGE("skipped: the NUMA system calls are refused here (" << why << ")");
    return;
  }
  using cache_t = inplace_kv_cache<G, host_backend, mlock_allocator, gpu_only>;
  const int node = first_node();
  const G lay(4, 2);
  try {
    host_backend be_a, be_b;
    cache_t plain(be_a, lay, cache_spec(), gpu_only{}, mlock_allocator{}, cache_options{true});
    cache_t bound(be_b, lay, cache_spec(), gpu_only{}, mlock_allocator{node}, cache_options{true});
    decode_driver<cache_t> da(plain, attention_options{1, true}, 17, gqa_scale);
    decode_driver<cache_t> db(bound, attention_options{1, true}, 17, gqa_scale);
    const std::vector<sequence_id> batch_a{da.add(3 * 32 + 30)}, batch_b{db.add(3 * 32 + 30)};
    REQUIRE(bound.usage().pinned_capacity_blocks == 8);
    for (int s = 0; s < 5; ++s) {  // the last pinned block is attended
      CAPTURE(s);
      REQUIRE(da.step(batch_a).ok());
      REQUIRE(db.step(batch_b).ok());
      CHECK(da.layer_out == db.layer_out);
      CHECK(da.layer_lse == db.layer_lse);
    }
    CHECK(bound.usage().pinned_used_blocks == 8);
    for (block_id id : {block_id{0}, block_id{7}}) {
      const numa_page_info b = numa_page_policy(bound.views(0).pinned_block(id));
      CHECK(b.mode == MPOL_BIND);
      CHECK(b.nodes == std::vector<int>{node});
      CHECK(b.node == node);
      CHECK(numa_page_policy(plain.views(0).pinned_block(id)).mode == MPOL_DEFAULT);
    }
  } catch (const pinned_memory_error& e) {  // RLIMIT_MEMLOCK too small here: refused at init, naming mlock
    const std::string what = e.what();
    if (what.find("with mlock failed") == std::string::npos) throw;
    MESSAGE("skipped: mlock refused here (" << what << ")");
  }
}

TEST_CASE("tensor_parallel: each rank's allocator gets its device's node on a host of several nodes, else as given") {
  using detail::tp_rank_allocator;
  const std::vector<int> one{0}, two{0, 1}, sparse{0, 2};
  // a host of several nodes: the device's node, when reported and online
  CHECK(tp_rank_allocator(mlock_allocator{}, 1, two).numa_node == 1);
  CHECK(tp_rank_allocator(mlock_allocator{}, 2, sparse).numa_node == 2);
  CHECK(tp_rank_allocator(mlock_allocator{}, no_numa_node, two).numa_node == no_numa_node);
  CHECK(tp_rank_allocator(mlock_allocator{}, 1, sparse).numa_node == no_numa_node);  // not online
  // one node: nothing placed
  CHECK(tp_rank_allocator(mlock_allocator{}, 0, one).numa_node == no_numa_node);
  // a node set by the caller is kept
  CHECK(tp_rank_allocator(mlock_allocator{0}, 1, two).numa_node == 0);
  // allocators without a node: copied as given
  static_assert(std::is_same_v<decltype(tp_rank_allocator(pageable_allocator{}, 1, two)), pageable_allocator>);

  // host_backend ranks (emulated devices: no node): the caller's node on every rank's region.
  std::string why;
  if (!numa_calls_available(why)) {
    MESSAGE("skipped the composite: the NUMA system calls are refused here (" << why << ")");
    return;
  }
  const int node = first_node();
  host_backend gpu0, gpu1;
  host_backend* ranks[] = {&gpu0, &gpu1};
  attention_options ao;
  ao.cpu_threads = 2;
  using tp_t = tensor_parallel_gqa<G, host_backend, mlock_allocator, gpu_only>;
  try {
    tp_t bound(ranks, G(8, 4), cache_spec(), gpu_only{}, ao, mlock_allocator{node});
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      const numa_page_info info = numa_page_policy(bound.cache(r).views(0).pinned_block(0));
      CHECK(info.mode == MPOL_BIND);
      CHECK(info.nodes == std::vector<int>{node});
    }
  } catch (const pinned_memory_error& e) {
    const std::string what = e.what();
    if (what.find("with mlock failed") == std::string::npos) throw;
    MESSAGE("skipped: mlock refused here (" << what << ")");
    return;
  }
  host_backend gpu2, gpu3;
  host_backend* more[] = {&gpu2, &gpu3};
  tp_t plain(more, G(8, 4), cache_spec(), gpu_only{}, ao, mlock_allocator{});
  for (int r = 0; r < 2; ++r) CHECK(numa_page_policy(plain.cache(r).views(0).pinned_block(0)).mode == MPOL_DEFAULT);
}

TEST_CASE("pci_device_numa_node: sysfs numa_node by bus id in either case; -1, absent or malformed ids: no node") {
  CHECK(pci_device_numa_node("") == no_numa_node);
  CHECK(pci_device_numa_node("not a bus id") == no_numa_node);
  CHECK(pci_device_numa_node("0000:00:00.0/../..") == no_numa_node);
  CHECK(pci_device_numa_node("ffff:ff:1f.7") == no_numa_node);  // no such device
  DIR* dir = ::opendir("/sys/bus/pci/devices");
  if (dir == nullptr) {
    MESSAGE("no /sys/bus/pci/devices here: only the absent cases ran");
    return;
  }
  int seen = 0;
  while (dirent* e = ::readdir(dir)) {
    const std::string id = e->d_name;
    if (id.size() != 12 || id[4] != ':') continue;
    std::ifstream in("/sys/bus/pci/devices/" + id + "/numa_node");
    int expect = no_numa_node;
    if (!(in >> expect) || expect < 0) expect = no_numa_node;
    std::string upper = id, wide = "0000" + id;
    for (char& c : upper) c = char(std::toupper(static_cast<unsigned char>(c)));
    CAPTURE(id);
    CHECK(pci_device_numa_node(id) == expect);
    CHECK(pci_device_numa_node(upper) == expect);  // cudaDeviceGetPCIBusId's upper case
    CHECK(pci_device_numa_node(wide) == expect);   // an eight-digit domain
    if (++seen == 8) break;
  }
  ::closedir(dir);
}
