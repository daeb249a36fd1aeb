#include "timeline.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>

namespace pycomm {
namespace comm {
namespace timeline {

std::atomic<bool> g_on{false};

namespace {

struct State {
  std::mutex mu;
  FILE* f = nullptr;
  std::string path;
  int rank = 0;
  Clock::time_point t0;
  std::map<std::string, int> lanes;
  std::vector<std::vector<std::string>> open;  // per lane: ranges begun and not ended, innermost last
  uint64_t generation = 0;  // start() increments it: ranges of an earlier run are dropped
};

State& state() {
  static State s;
  return s;
}

// The lanes of the batch running on this thread, and the run they belong to.
thread_local std::vector<int> t_lanes;
thread_local uint64_t t_generation = 0;

std::string escape(const std::string& in) {
  std::string out;
  for (char c : in) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += c;
  }
  return out;
}

double micros(const State& s, Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t - s.t0).count();
}

// Locked helpers: s.mu held and s.f open.
void emit(State& s, const char* ph, int lane, const std::string& name, Clock::time_point t,
          const std::string& extra = "") {
  std::fprintf(s.f, ",\n{\"name\":\"%s\",\"ph\":\"%s\",\"ts\":%.3f,\"pid\":%d,\"tid\":%d%s}", escape(name).c_str(), ph,
               micros(s, t), s.rank, lane, extra.c_str());
}

int lane_of(State& s, const Signature& sig) {
  std::string name = sig.name[0] ? std::string(sig.name) : sig.describe().substr(0, sig.describe().find(' '));
  auto it = s.lanes.find(name);
  if (it != s.lanes.end()) return it->second;
  const int lane = static_cast<int>(s.lanes.size()) + 1;
  s.lanes.emplace(name, lane);
  s.open.resize(static_cast<size_t>(lane) + 1);
  std::fprintf(s.f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}", s.rank,
               lane, escape(name).c_str());
  return lane;
}

void begin(State& s, int lane, const std::string& name, Clock::time_point t) {
  emit(s, "B", lane, name, t);
  s.open[static_cast<size_t>(lane)].push_back(name);
}

// Ends `name` on `lane` (and anything opened inside it); ignored if it is not open.
void end(State& s, int lane, const std::string& name, Clock::time_point t, const std::string& extra = "") {
  auto& stack = s.open[static_cast<size_t>(lane)];
  size_t depth = stack.size();
  while (depth > 0 && stack[depth - 1] != name) --depth;
  if (depth == 0) return;
  while (stack.size() >= depth) {
    emit(s, "E", lane, stack.back(), t, stack.size() == depth ? extra : "");
    stack.pop_back();
  }
}

std::string kind_upper(const Signature& sig) {
  std::string k = sig.describe();
  k = k.substr(0, k.find(' '));
  for (char& c : k) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return k;
}

}  // namespace

void start(const std::string& path, int rank) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.f) throw CommError("pycomm timeline: already writing " + s.path + "; stop_timeline() first");
  std::string file = path;
  const size_t slash = file.find_last_of('/');
  const size_t dot = file.find_last_of('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot != std::string::npos && (slash == std::string::npos || dot > slash)) file.insert(dot, tag);
  else file += tag;
  FILE* f = std::fopen(file.c_str(), "w");
  if (!f) throw CommError("pycomm timeline: cannot open '" + file + "' for writing (rank " + std::to_string(rank) + ")");
  s.f = f;
  s.path = file;
  s.rank = rank;
  s.t0 = Clock::now();
  s.lanes.clear();
  s.open.assign(1, {});
  ++s.generation;
  std::fprintf(f, "{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
               "\"args\":{\"name\":\"rank %d\"}}", rank, rank);
  g_on.store(true, std::memory_order_relaxed);
}

void stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  g_on.store(false, std::memory_order_relaxed);
  if (!s.f) return;
  const Clock::time_point t = Clock::now();
  for (size_t lane = 0; lane < s.open.size(); ++lane)
    while (!s.open[lane].empty()) {
      emit(s, "E", static_cast<int>(lane), s.open[lane].back(), t);
      s.open[lane].pop_back();
    }
  std::fprintf(s.f, "\n],\"displayTimeUnit\":\"ms\"}\n");
  std::fclose(s.f);
  s.f = nullptr;
  s.path.clear();
  ++s.generation;
}

std::string running_path() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.path;
}

void begin_phase(const char* name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.f || t_generation != s.generation) return;
  const Clock::time_point t = Clock::now();
  for (int lane : t_lanes) begin(s, lane, name, t);
}

void end_phase(const char* name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.f || t_generation != s.generation) return;
  const Clock::time_point t = Clock::now();
  for (int lane : t_lanes) end(s, lane, name, t);
}

Batch::Batch(const std::vector<Signature>& proposal, const std::vector<Clock::time_point>& submitted) {
  if (!on() || submitted.size() != proposal.size()) return;
  active_ = true;
  proposal_ = &proposal;
  submitted_ = submitted;
  start_ = Clock::now();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.f) {
    active_ = false;
    return;
  }
  generation_ = s.generation;
  for (const Signature& sig : proposal) lanes_.push_back(lane_of(s, sig));
  // NEGOTIATE runs before the round says how many of these run: it goes on the head's lane now.
  t_lanes.assign(1, lanes_.front());
  t_generation = generation_;
}

void Batch::decided(size_t count) {
  if (!active_) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.f || s.generation != generation_) {
    active_ = false;
    t_lanes.clear();
    return;
  }
  const Clock::time_point t = Clock::now();
  count = std::min(count, lanes_.size());
  lanes_.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const Signature& sig = (*proposal_)[i];
    const double queued_us = std::chrono::duration<double, std::micro>(start_ - submitted_[i]).count();
    emit(s, "X", lanes_[i], "QUEUED", submitted_[i], ",\"dur\":" + std::to_string(std::max(queued_us, 0.0)));
    begin(s, lanes_[i], kind_upper(sig), start_);
    begin(s, lanes_[i], "NEGOTIATE", start_);
    end(s, lanes_[i], "NEGOTIATE", t);
  }
  t_lanes = lanes_;
}

Batch::~Batch() {
  if (!active_) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.f && s.generation == generation_) {
    const Clock::time_point t = Clock::now();
    std::ostringstream tensors;
    for (size_t i = 0; i < lanes_.size(); ++i) {
      const Signature& sig = (*proposal_)[i];
      tensors << (i ? "," : "") << "\"" << escape(sig.name[0] ? sig.name : sig.describe()) << "\"";
    }
    const std::string args = ",\"args\":{\"tensors\":[" + tensors.str() + "],\"fused\":" + std::to_string(lanes_.size()) + "}";
    for (size_t i = 0; i < lanes_.size(); ++i) {
      end(s, lanes_[i], kind_upper((*proposal_)[i]), t, args);
      emit(s, "i", lanes_[i], "DONE", t, ",\"s\":\"t\"");
    }
  }
  t_lanes.clear();
}

}  // namespace timeline
}  // namespace comm
}  // namespace pycomm
