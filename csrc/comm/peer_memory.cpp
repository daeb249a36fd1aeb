// The peer path's host stand-in (peer_memory.h): blocks are POSIX shared-memory
// objects that the node's other processes map by name, as CUDA IPC maps device
// memory by handle. The work runs on the engine thread, so by the time a host
// barrier follows a signal the memory holds what the signal stands for.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "../kernels/reduce.h"
#include "common.h"
#include "peer_memory.h"

namespace pycomm {
namespace comm {
namespace {

std::string name_of(const PeerMemory::Handle& h) {
  return std::string(h.bytes, strnlen(h.bytes, PeerMemory::kHandleBytes));
}

void* map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) throw CommError("peer memory: mmap of " + name + ": " + std::strerror(err));
  return p;
}

class HostPeerMemory : public PeerMemory {
 public:
  const char* kind() const override { return "host shared memory"; }

  void* export_block(size_t bytes, Handle* handle) override {
    static std::atomic<unsigned> serial{0};
    const std::string name = "/pycomm-peer-" + std::to_string(getpid()) + "-" + std::to_string(serial++);
    if (name.size() >= kHandleBytes) throw CommError("peer memory: name too long: " + name);
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw CommError("peer memory: shm_open " + name + ": " + std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(bytes ? bytes : 1)) != 0) {
      const int err = errno;
      close(fd);
      shm_unlink(name.c_str());
      throw CommError("peer memory: " + std::to_string(bytes) + " bytes for " + name + ": " + std::strerror(err));
    }
    std::memset(handle->bytes, 0, kHandleBytes);
    std::memcpy(handle->bytes, name.data(), name.size());
    return map(fd, bytes, name);
  }
  void unpublish(const Handle& handle) override { shm_unlink(name_of(handle).c_str()); }
  void release_block(void* block, size_t bytes) override { munmap(block, bytes ? bytes : 1); }
  void* open_block(const Handle& handle, size_t bytes) override {
    const std::string name = name_of(handle);
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw CommError("peer memory: cannot open a peer's block " + name + ": " + std::strerror(errno));
    return map(fd, bytes, name);
  }
  void close_block(void* block, size_t bytes) override { munmap(block, bytes ? bytes : 1); }

  // The work is done when the call returns: the host barrier after signal() is the whole order.
  void export_signals(Handle handles[kSignals]) override {
    for (int k = 0; k < kSignals; ++k) handles[k] = Handle{};
  }
  void* open_signal(const Handle&) override { return this; }
  void close_signal(void*) override {}
  void signal(int) override {}
  void wait_signal(void*) override {}

  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void reduce(void* dst, const void* src, size_t count, kernels::DType dtype, kernels::ReduceOp op) override {
    kernels::reduce_cpu(dst, src, count, dtype, op);
  }
  void scale(void* dst, size_t count, kernels::DType dtype, double factor) override {
    kernels::scale_cpu(dst, count, dtype, factor);
  }
  void synchronize() override {}
};

}  // namespace

std::unique_ptr<PeerMemory> make_host_peer_memory() { return std::make_unique<HostPeerMemory>(); }

}  // namespace comm
}  // namespace pycomm
