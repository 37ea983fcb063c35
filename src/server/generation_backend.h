// What the OpenAI API (server/openai_api.h) generates with: the colocated
// engine, or the disaggregated router (server/router.h) that drives prefill
// and decode instances. Both answer a request with the engine's output
// contract (engine/engine.h): one output per token, then exactly one final
// output.
//
// Threads: every method may be called from any thread. Output callbacks may
// run on any thread (the engine thread, a router worker), one at a time per
// request; they must not block.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "engine/engine.h"

namespace moe::server {

class GenerationBackend {
 public:
  virtual ~GenerationBackend() = default;
  // `request_id` (the client's X-Request-Id) is propagated to every instance.
  virtual Expected<uint64_t> submit(engine::EngineRequest request, engine::OutputCallback on_output,
                                    const std::string& request_id) = 0;
  // Ends request `id`: finish kAbort (the client left), or kStop when the
  // caller cut its text at a stop string (what the metrics then count).
  virtual void cancel(uint64_t id, engine::FinishReason finish) = 0;
  virtual int64_t vocab_size() const = 0;
  virtual bool healthy() const = 0;
  // The Prometheus text of GET /metrics.
  virtual std::string metrics_text(const std::string& model_name) const = 0;
};

// The colocated engine as a backend.
class EngineBackend final : public GenerationBackend {
 public:
  explicit EngineBackend(engine::Engine& engine) : engine_(engine) {}
  Expected<uint64_t> submit(engine::EngineRequest request, engine::OutputCallback on_output,
                            const std::string&) override {
    return engine_.submit(std::move(request), std::move(on_output));
  }
  void cancel(uint64_t id, engine::FinishReason finish) override { engine_.cancel(id, finish); }
  int64_t vocab_size() const override { return engine_.vocab_size(); }
  bool healthy() const override { return engine_.healthy(); }
  std::string metrics_text(const std::string& model_name) const override;

 private:
  engine::Engine& engine_;
};

}  // namespace moe::server
