// SPDX-License-Identifier: Apache-2.0
// writescope/numa.hpp — NUMA nodes of the host and page placement on them
// (docs/MULTI-GPU.md, NUMA placement).
//
// On a host with more than one NUMA node, a pinned load region read by a GPU
// is best placed on the node nearest that GPU: its DMA reads then do not cross
// the inter-socket link. The page-owning pinned allocators (mlock_allocator,
// cuda_host_register) take an optional node and use this header to bind their
// pages before the first touch; cuda/numa.hpp finds a CUDA device's node.
//
//   numa_online_nodes()         the host's online nodes, ascending, from
//                               /sys/devices/system/node/online; a host
//                               without that file has one node, {0}
//   parse_numa_node_list(text)  "0", "0-1", "0,2-3" -> {0}, {0, 1}, {0, 2, 3}
//   format_numa_node_list(v)    the other way ({0, 2, 3} -> "0,2-3")
//   require_online_numa_node    config_error unless the node is online
//   numa_bind(p, bytes, node)   mbind(MPOL_BIND) of a page-aligned range to one
//                               node, before its pages are first touched
//   numa_page_policy(p)         the policy, its nodes and the node of the page
//                               holding p (get_mempolicy; tests, diagnostics)
//   pci_device_numa_node(id)    the node of a PCI device by bus id
//                               ("0000:3B:00.0"), from sysfs; no_numa_node
//                               where the platform does not say
//
// The system calls go through syscall(2) (SYS_mbind, SYS_get_mempolicy; the
// constants of <linux/mempolicy.h>): no libnuma.
//
// Units: bytes; node numbers as the kernel numbers them (0-based).
// Errors: config_error for a node that is not online (naming it and the online
// list) or a malformed node list; shape_error for a range that does not start
// on a page boundary; resource_error when the kernel refuses mbind or
// get_mempolicy (naming the errno text, the node and the bytes). A call that
// throws leaves the range's policy as it was.
// Threads: every function may run on any thread; none keeps state (the sysfs
// files are read on each call). A memory policy set by numa_bind belongs to
// the mapping, so pages touched by any thread of the process land on the node.
#pragma once

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config.hpp"
#include "error.hpp"

namespace writescope {

/// "No NUMA node": no placement (the allocators' default), or a device whose
/// node the platform does not report.
inline constexpr int no_numa_node = -1;

/// Highest node number + 1 that numa_bind and numa_page_policy handle (the
/// size of their node masks).
inline constexpr int max_numa_nodes = 1024;

/// The nodes of a kernel node list ("0", "0-1", "0,2-3"; whitespace and a
/// trailing newline ignored), ascending and without repeats; an empty or
/// blank text gives an empty list. Throws config_error naming the text when
/// it is malformed (not numbers, a range whose end is below its start, a node
/// >= max_numa_nodes).
inline std::vector<int> parse_numa_node_list(std::string_view text) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s.push_back(c);
  std::vector<int> nodes;
  if (s.empty()) return nodes;
  auto bad = [&](const char* why) {
    throw config_error("numa: malformed node list \"" + std::string(text) + "\": " + why);
  };
  auto number = [&](std::string_view t) {
    if (t.empty()) bad("an empty entry");
    int v = 0;
    for (char c : t) {
      if (c < '0' || c > '9') bad("not a number");
      v = v * 10 + (c - '0');
      if (v >= max_numa_nodes) bad("a node number too large");
    }
    return v;
  };
  std::string_view rest(s);
  while (true) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const auto dash = item.find('-');
    const int first = number(item.substr(0, dash));
    const int last = dash == std::string_view::npos ? first : number(item.substr(dash + 1));
    if (last < first) bad("a range whose end is below its start");
    for (int n = first; n <= last; ++n) nodes.push_back(n);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

/// The compact kernel form of an ascending node list: {0, 2, 3} -> "0,2-3"; {} -> "".
inline std::string format_numa_node_list(std::span<const int> nodes) {
  std::string out;
  for (std::size_t i = 0; i < nodes.size();) {
    std::size_t j = i;
    while (j + 1 < nodes.size() && nodes[j + 1] == nodes[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(nodes[i]);
    if (j > i) out += '-' + std::to_string(nodes[j]);
    i = j + 1;
  }
  return out;
}

/// The host's online NUMA nodes (/sys/devices/system/node/online), ascending;
/// {0} on a host without that file or with an empty one. Throws config_error
/// when the file is malformed.
inline std::vector<int> numa_online_nodes() {
  std::ifstream in("/sys/devices/system/node/online");
  if (!in) return {0};
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int> nodes = parse_numa_node_list(text);
  if (nodes.empty()) nodes.push_back(0);
  return nodes;
}

/// Throws config_error unless `node` is one of the host's online nodes; the
/// message names `what`, the node and the online list.
inline void require_online_numa_node(int node, std::string_view what) {
  const std::vector<int> online = numa_online_nodes();
  if (std::find(online.begin(), online.end(), node) != online.end()) return;
  throw config_error(std::string(what) + ": NUMA node " + std::to_string(node) +
                     " is not an online node of this host (online nodes: " + format_numa_node_list(online) + ")");
}

namespace detail {

using numa_mask = std::uint64_t[max_numa_nodes / 64];
// The kernel reads maxnode - 1 bits of a mask (mbind, get_mempolicy).
inline constexpr unsigned long numa_mask_maxnode = max_numa_nodes + 1;

/// mbind(MPOL_BIND) of [p, p + bytes) to `node`: empty on success, otherwise
/// the refusal ("mbind of <bytes> bytes to NUMA node <n> failed: <errno text>").
inline std::string numa_bind_refusal(void* p, index_t bytes, int node) {
  numa_mask mask{};
  mask[node / 64] = std::uint64_t{1} << (node % 64);
  if (::syscall(SYS_mbind, p, static_cast<unsigned long>(bytes), MPOL_BIND, mask, numa_mask_maxnode, 0u) == 0)
    return {};
  const int err = errno;
  return "mbind of " + std::to_string(bytes) + " bytes to NUMA node " + std::to_string(node) + " failed: " +
         std::strerror(err);
}

}  // namespace detail

/// Binds the pages of [p, p + bytes) to NUMA node `node` (MPOL_BIND): pages
/// first touched afterwards are allocated on that node only. Call it before
/// the range is touched (pages already present stay where they are). `p`
/// must be page-aligned (an mmap'ed range); `bytes` is rounded up to pages by
/// the kernel; bytes <= 0 does nothing. Throws config_error when `node` is not
/// online, shape_error when `p` is not page-aligned, resource_error when the
/// kernel refuses (naming the errno text, the node and the size); the range's
/// policy is then unchanged.
inline void numa_bind(void* p, index_t bytes, int node) {
  if (bytes <= 0) return;
  require_online_numa_node(node, "numa_bind");
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(page) != 0)
    throw shape_error("numa_bind: the range must start on a page boundary (" + std::to_string(page) +
                      " bytes); it starts at offset " +
                      std::to_string(reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(page)) +
                      " in its page");
  if (std::string m = detail::numa_bind_refusal(p, bytes, node); !m.empty()) throw resource_error("numa: " + m);
}

/// The memory policy of the mapping holding an address, and where its page is.
struct numa_page_info {
  int mode = MPOL_DEFAULT;  ///< MPOL_DEFAULT, MPOL_BIND, ... (<linux/mempolicy.h>), mode flags removed
  std::vector<int> nodes;   ///< the policy's nodes (empty for MPOL_DEFAULT)
  int node = no_numa_node;  ///< the node of the page holding the address
};

/// The policy of the mapping that holds `p` (get_mempolicy with MPOL_F_ADDR)
/// and the node of its page (MPOL_F_ADDR | MPOL_F_NODE; a page not yet
/// present is faulted in by this read, as a load would). For tests and
/// diagnostics. Throws resource_error naming the errno text when the kernel
/// refuses (p not mapped, no NUMA support).
inline numa_page_info numa_page_policy(const void* p) {
  numa_page_info info;
  detail::numa_mask mask{};
  int mode = 0;
  auto refused = [&](const char* which) {
    const int err = errno;
    throw resource_error(std::string("numa: get_mempolicy(") + which + ") failed: " + std::strerror(err));
  };
  if (::syscall(SYS_get_mempolicy, &mode, mask, detail::numa_mask_maxnode, p, MPOL_F_ADDR) != 0)
    refused("MPOL_F_ADDR");
  info.mode = mode & ~int(MPOL_MODE_FLAGS);
  for (int n = 0; n < max_numa_nodes; ++n)
    if ((mask[n / 64] >> (n % 64)) & 1u) info.nodes.push_back(n);
  if (info.mode == MPOL_DEFAULT) info.nodes.clear();  // the kernel reports no nodes for it; be explicit
  int node = no_numa_node;
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0ul, p, MPOL_F_ADDR | MPOL_F_NODE) != 0)
    refused("MPOL_F_ADDR | MPOL_F_NODE");
  info.node = node;
  return info;
}

/// The NUMA node of the PCI device with bus id `bus_id` ("domain:bus:device.function"
/// in hex, as cudaDeviceGetPCIBusId writes it: "0000:3B:00.0" or
/// "00000000:3B:00.0"), from /sys/bus/pci/devices/<dddd:bb:dd.f, lower case>/numa_node.
/// no_numa_node when the id does not parse, the file is absent or unreadable,
/// or it reads -1 or anything but a node number (a platform that does not
/// report the device's node). Never throws for a missing device.
inline int pci_device_numa_node(std::string_view bus_id) {
  const std::string id_text(bus_id.substr(0, std::min<std::size_t>(bus_id.size(), 64)));
  unsigned domain = 0, bus = 0, dev = 0, fn = 0;
  char tail = 0;
  if (std::sscanf(id_text.c_str(), "%x:%x:%x.%x%c", &domain, &bus, &dev, &fn, &tail) != 4) return no_numa_node;
  char id[32];
  std::snprintf(id, sizeof id, "%04x:%02x:%02x.%x", domain, bus, dev, fn);
  std::ifstream in(std::string("/sys/bus/pci/devices/") + id + "/numa_node");
  std::string word;
  if (!(in >> word)) return no_numa_node;
  if (word.size() > 6 || !std::all_of(word.begin(), word.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return no_numa_node;  // "-1", "unknown", ...
  const int node = std::stoi(word);
  return node < max_numa_nodes ? node : no_numa_node;
}

}  // namespace writescope
