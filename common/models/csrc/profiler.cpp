// libtorch's own profiler (Kineto; on a GPU through CUPTI, which the
// PyTorch wheel ships), which tch does not expose: every op on the host
// with its input shapes, and every kernel, copy and memset on the device
// with the correlation id of the op that launched it. The device machines
// have neither nsys nor ncu; this is how a step's time is taken apart
// (src/kernel_profile.rs).
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/autograd/profiler_kineto.h>

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

namespace {
struct Profile {
  std::vector<prof::KinetoEvent> events;
  std::vector<std::string> names;
  std::vector<std::string> shapes;
};

void say(char* err, size_t len, const char* what) { std::snprintf(err, len, "%s", what); }

ProfilerConfig config() { return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true); }

std::set<ActivityType> activities(int cuda) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (cuda) a.insert(ActivityType::CUDA);
  return a;
}
}  // namespace

// One event, as the Rust side reads it; the strings live as long as the profile.
struct DflashProfileEvent {
  const char* name;
  const char* shapes;
  uint64_t start_ns;
  uint64_t duration_ns;
  uint64_t correlation;
  uint64_t linked_correlation;
  uint64_t thread;
  uint8_t activity;  // libkineto::ActivityType
  uint8_t on_device;
};

extern "C" int dflash_profiler_start(int cuda, char* err, size_t err_len) {
  try {
    prof::prepareProfiler(config(), activities(cuda));
    prof::enableProfiler(config(), activities(cuda));
    return 0;
  } catch (const std::exception& e) {
    say(err, err_len, e.what());
    return 1;
  }
}

extern "C" void* dflash_profiler_stop(char* err, size_t err_len) {
  try {
    auto result = prof::disableProfiler();
    auto* p = new Profile();
    p->events = result->events();
    p->names.reserve(p->events.size());
    p->shapes.reserve(p->events.size());
    for (const auto& e : p->events) {
      p->names.push_back(e.name());
      std::string s;
      if (e.hasShapes()) {
        for (const auto& shape : e.shapes()) {
          s += '[';
          for (size_t i = 0; i < shape.size(); i++) s += (i ? "," : "") + std::to_string(shape[i]);
          s += ']';
        }
      }
      p->shapes.push_back(std::move(s));
    }
    return p;
  } catch (const std::exception& e) {
    say(err, err_len, e.what());
    return nullptr;
  }
}

extern "C" size_t dflash_profile_len(void* profile) { return static_cast<Profile*>(profile)->events.size(); }

extern "C" void dflash_profile_event(void* profile, size_t i, DflashProfileEvent* out) {
  const auto* p = static_cast<Profile*>(profile);
  const auto& e = p->events[i];
  out->name = p->names[i].c_str();
  out->shapes = p->shapes[i].c_str();
  out->start_ns = e.startNs();
  out->duration_ns = e.durationNs();
  out->correlation = e.correlationId();
  out->linked_correlation = e.linkedCorrelationId();
  out->thread = e.startThreadId();
  out->activity = e.activityType();
  out->on_device = e.deviceType() != c10::DeviceType::CPU;
}

extern "C" void dflash_profile_free(void* profile) { delete static_cast<Profile*>(profile); }
