// Wire protocol of the parameter server, on a communicator of its own (a
// duplicate of pycomm's world, so it never matches the collective engine's
// traffic).
//
// Every request is one header of kHeaderWords int64 on kTagRequest; a request
// that carries data (init, push, load) is followed by one data message on
// kTagData. MPI keeps messages of one (source, tag) in order, so a server that
// takes a header and then receives kTagData from the same source gets that
// request's data, and one worker's requests are served in the order it sent
// them: its pushes are applied before its later pull, clock or flush.
// Replies go to the worker's reply tag (one per outstanding request): a header
// of kReplyWords int64 (status, version or size) and, for pull/save/stats, data.
//
// Push and init data travel in chunks of kChunkBytes (the last one shorter), all
// sent at once: the server applies the update to each chunk as it lands, while it
// is still in cache, instead of after the whole shard.
// A worker's request to the server thread of its own process (co-located) carries
// no data message: the header's arg is the address of the worker's buffer, the
// server reads (push) or writes (pull) it in place and answers with a reply
// header; the worker's wait() returns only after that answer. A push_pull of the
// local shard is one request (kPushPullLocal): the server updates the shard block
// by block and copies each block out while it is still in cache, so the local
// pull never reads the shard from memory again.
//
// A worker on the server's host (same host name and pid namespace, and the kernel lets
// the server attach to its memory: probed when the ParameterServer is made) sends only
// headers too (kPushShared, kPullShared, kPushPullShared): word kPidField is its pid,
// and the server reads the gradient and writes the weights in the worker's address
// space with process_vm_readv / process_vm_writev, block by block, while each block is
// in cache. No data message crosses MPI, and the worker takes no part in moving the
// data: it only waits for the answer (testing and yielding its core).
//
// Bytes per push of S bytes over K servers: S/K data + 64 B header per server
// (the local shard: 64 B header + 16 B answer); per pull the same in the other
// direction plus a 16 B reply header.
#pragma once
#include <cstddef>
#include <cstdint>

namespace pycomm {
namespace ps {

constexpr int kTagRequest = 1;
constexpr int kTagData = 2;
constexpr int kReplyTagBase = 1000;
constexpr int kReplyTagCount = 30000;  // MPI guarantees tags up to 32767

constexpr int kHeaderWords = 8;
constexpr size_t kChunkBytes = size_t(1) << 20;
constexpr size_t kChunkFloats = kChunkBytes / sizeof(float);
constexpr int kReplyWords = 2;
constexpr size_t kCacheBlockFloats = size_t(32) << 10;  // 128 KiB: a block of gradient, weights and copy in L2
constexpr size_t kScratchSlots = 4;  // a server's push receive window, in chunks

enum Op : int64_t {
  kInit = 1,     // key, total, count | data: this server's shard of the initial value
  kPush = 2,     // key, total, count | data: the gradient's shard
  kPull = 3,     // key, total, count, reply tag -> [status, version] + data
  kClock = 4,    // clock c, reply tag -> [status, 0] once min over workers of clock >= c - bound
  kFlush = 5,    // reply tag -> [status, 0] after every earlier request of this worker
  kDone = 6,     // this worker sends nothing more
  kStats = 7,    // reply tag -> [status, words] + int64 words (histograms, counters)
  kSave = 8,     // reply tag -> [status, bytes] + the serialized server state
  kLoad = 9,     // bytes, reply tag | data: a serialized state -> [status, 0]
  kClockPull = 10,  // as kClock, and the answer carries every shard, in key order, read at that moment:
                    // [status, shards] + one data message per shard. With bound 0 this is exact BSP.
  kPushLocal = 11,  // as kPush from the server's own process; arg: address of the gradient's shard,
                    // reply tag -> [status, version] once applied
  kPullLocal = 12,  // as kPull from the server's own process; arg: address to write the shard to
  kPushPullLocal = 13,  // kPushLocal then kPullLocal of the same key in one pass over the shard:
                        // arg: the gradient's address, word kOutField: where the updated shard goes,
                        // reply tag -> [status, version] once both are done
  kPushShared = 14,      // as kPushLocal from another process of this host: arg is an address in process
                         // kPidField, read with process_vm_readv
  kPullShared = 15,      // as kPullLocal from another process of this host (process_vm_writev)
  kPushPullShared = 16,  // as kPushPullLocal from another process of this host
};

enum Status : int64_t { kOk = 0, kUninitialized = 1, kBadRequest = 2, kBadState = 3, kMemoryAccess = 4 };

// Header layout: [op, key, total, count, arg, reply_tag, out, pid].
enum HeaderField {
  kOpField = 0, kKeyField = 1, kTotalField = 2, kCountField = 3, kArgField = 4, kReplyField = 5, kOutField = 6,
  kPidField = 7
};

constexpr int kHistogramBins = 64;  // staleness 0..62, and >= 63 in the last bin

}  // namespace ps
}  // namespace pycomm
