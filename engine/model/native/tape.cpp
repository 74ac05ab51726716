// A block of ops traced once and run as one primitive (`Tape`).
//
// Why: on a CPU a small model's decode step is bound by per-op costs, not arithmetic. mlx
// evaluates a graph op by op on the calling thread (allocating each op's outputs, ordering it,
// queueing its task under a lock) and runs each op as a task of its own on the stream's one
// thread; a plain demo step was ~80 ops, and the calling thread's share of that work took the
// core the product pool's worker needs. A tape is one op to mlx:
//
// * Laid out (`Tape::lay_out`): its nodes are evaluated on the calling thread in trace order,
//   the work of this module's primitives recorded and handed to the stream as one task; a
//   node of another library (mlx's views, a compiled elementwise kernel) is evaluated as mlx
//   would, after the work recorded so far is handed out (the stream runs tasks in the order
//   they are handed out).
// * Run again (`Tape::run_again`): a tape of this module's primitives and mlx's views of their
//   outputs keeps its first run's recorded work and the values between its nodes; a later run
//   allocates its outputs, redoes the views of them, and hands the same work over its new
//   arguments and outputs to the stream as one task: no node is evaluated on the calling
//   thread.
//
// Exactness: every node runs the same primitive with the same parameters over the same inputs
// as the traced graph, in an order the graph allows, so every output is bit for bit the traced
// ops' (tests/unit/test_tape.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <stdexcept>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels.h"
#include "mlx/primitives.h"
#include "primitive.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace mtpserve {

std::vector<RecordedWork>*& recorded_work() {
  thread_local std::vector<RecordedWork>* sink = nullptr;
  return sink;
}

namespace {

// Whether `p` is one of this module's primitives, whose work goes through `dispatch`.
bool ours(const mx::Primitive& p) {
  return std::strstr(typeid(p).name(), "mtpserve") != nullptr;
}

// mlx's primitives that only look at their input's memory another way (no work of their own
// where the input is row-contiguous, as this module's outputs are).
bool a_view(const mx::Primitive& p) {
  static const std::unordered_set<std::string> views{"Reshape",   "Slice",   "Split",
                                                     "Transpose", "Squeeze", "ExpandDims"};
  return views.count(p.name()) > 0;
}

// A tape runs its recorded work again (`Replay`) when the values between its nodes take at
// most kReplayBytes and every tape's together at most kReplayBudget: they are then kept from
// run to run. Past that (a large model's batched verify, whose per-op costs are a small part of
// its time) each run lays its nodes out anew.
constexpr int64_t kReplayBytes = 1 << 20;
constexpr int64_t kReplayBudget = 64 << 20;
std::atomic<int64_t> replay_bytes{0};  // kept by every Replay alive

struct TapeNode {
  std::shared_ptr<mx::Primitive> primitive;
  std::vector<int> inputs;  // value numbers
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  int first_output;  // value number of its first output (the others follow)
  bool ours;
  bool view;  // a_view, over a value of this tape's nodes
};

// What the first run of a tape of this module's primitives and mlx's views recorded, to run
// again: each of this module's nodes' work, with the slots that change from run to run named.
// Which values change: the arguments, the tape's outputs, and every value a view joins to one
// of them (a view shares its input's memory); each run gives those fresh buffers, and redoes
// the views among them on the calling thread. The values between the nodes otherwise are the
// first run's, kept: runs of one tape never overlap (the stream's one thread runs its tasks in
// turn), so each run writes them before it reads them.
struct Replay {
  struct Slot {
    bool output_side;  // RecordedWork::out, else ::in
    int index;         // in that vector
    int fresh;         // in Replay::fresh
  };
  // A value each run makes anew: an argument, or output `output` of node `node` (a view's
  // input is the fresh value `input`).
  struct Fresh {
    int argument;  // >= 0: that argument
    int node;
    int output;
    int input;
  };
  std::vector<RecordedWork> work;        // this module's nodes', in trace order
  std::vector<std::vector<Slot>> slots;  // per work
  std::vector<Fresh> fresh;              // in value order
  std::vector<int> output_fresh;         // per tape output: in `fresh`, -1 for a constant
  std::vector<mx::array> kept;           // the others between the nodes
  int64_t kept_bytes = 0;                // counted in replay_bytes while this lives
  ~Replay() { replay_bytes -= kept_bytes; }
};

// Values are numbered: the arguments, then the constants (arrays the block read that were
// already evaluated: weights), then every node's outputs in trace order.
struct TapeGraph {
  int arguments = 0;
  std::vector<mx::Shape> argument_shapes;
  std::vector<mx::Dtype> argument_dtypes;
  std::vector<mx::array> constants;
  std::vector<TapeNode> nodes;
  std::vector<int> outputs;
  std::vector<mx::Shape> output_shapes;
  std::vector<mx::Dtype> output_dtypes;
  bool replayable = false;  // only this module's nodes and views of their values
  std::mutex lock;
  std::shared_ptr<Replay> replay;  // once recorded
  bool recorded = false;

  int first_node_value() const { return arguments + static_cast<int>(constants.size()); }
};

// The values a run of `g` makes anew (Replay): the arguments, the outputs, and the values views
// join to them, either way, until none is added.
std::vector<bool> fresh_values(const TapeGraph& g, int values) {
  std::vector<bool> fresh(values, false);
  for (int a = 0; a < g.arguments; ++a) fresh[a] = true;
  for (int v : g.outputs)
    if (v >= g.first_node_value()) fresh[v] = true;  // a constant shown as an output stays one
  for (bool added = true; added;) {
    added = false;
    for (const TapeNode& node : g.nodes) {
      if (!node.view) continue;
      bool any = fresh[node.inputs[0]];
      for (size_t j = 0; j < node.shapes.size(); ++j) any = any || fresh[node.first_output + j];
      if (!any) continue;
      const auto mark = [&](int v) {
        if (!fresh[v]) fresh[v] = added = true;
      };
      mark(node.inputs[0]);
      for (size_t j = 0; j < node.shapes.size(); ++j) mark(node.first_output + j);
    }
  }
  return fresh;
}

class Tape : public mx::Primitive {
 public:
  Tape(mx::Stream stream, std::shared_ptr<TapeGraph> graph)
      : mx::Primitive(stream), graph_(std::move(graph)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    std::shared_ptr<Replay> replay;
    bool record = false;
    if (graph_->replayable) {
      std::lock_guard<std::mutex> guard(graph_->lock);
      replay = graph_->replay;
      record = !graph_->recorded;
      graph_->recorded = true;
    }
    if (replay)
      run_again(replay, inputs, outputs);
    else
      lay_out(inputs, outputs, record);
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("Tape runs on the CPU only");
  }

  const char* name() const override { return "Tape"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return graph_ == static_cast<const Tape&>(other).graph_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    return graph_->output_shapes;
  }

 private:
  // Every node evaluated on this thread in trace order, this module's work recorded and run as
  // one task, another library's evaluated as mlx would after the work recorded so far is handed
  // out. With `record`, the run's work is kept to run again (`Replay`) where it can be.
  void lay_out(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
               bool record) {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> values(inputs.begin(), inputs.end());  // arguments and constants
    std::vector<RecordedWork> work, all_work;  // all_work: every node's, when recording
    const auto hand_out_work = [&] {
      if (work.empty()) return;
      if (record) all_work.insert(all_work.end(), work.begin(), work.end());
      encoder.dispatch([work = std::move(work)]() mutable {
        for (auto& w : work) w();
      });
      work = {};
    };
    for (const TapeNode& node : graph_->nodes) {
      std::vector<mx::array> in;
      in.reserve(node.inputs.size());
      for (int v : node.inputs) in.push_back(values[v]);
      auto out = mx::array::make_arrays(node.shapes, node.dtypes, node.primitive, in);
      if (node.ours) {
        struct Recording {
          explicit Recording(std::vector<RecordedWork>* sink) { recorded_work() = sink; }
          ~Recording() { recorded_work() = nullptr; }
        } recording(&work);
        node.primitive->eval_cpu(in, out);
      } else {
        hand_out_work();
        node.primitive->eval_cpu(in, out);
      }
      for (auto& o : out) values.push_back(std::move(o));
    }
    for (size_t i = 0; i < outputs.size(); ++i)
      outputs[i].copy_shared_buffer(values[graph_->outputs[i]]);
    if (record) {
      all_work.insert(all_work.end(), work.begin(), work.end());
      keep_to_run_again(all_work, values);
    }
    // the last of the work, and every value kept until it has run (the work holds weak copies)
    encoder.dispatch([work = std::move(work), values = std::move(values)]() mutable {
      for (auto& w : work) w();
    });
  }

  // A copy of a run's work as a `Replay`, if each of this module's nodes recorded one work over
  // its own inputs and outputs, each view shares its input's memory, and the values kept take
  // at most kReplayBytes.
  void keep_to_run_again(const std::vector<RecordedWork>& work,
                         const std::vector<mx::array>& values) {
    const TapeGraph& g = *graph_;
    const std::vector<bool> fresh = fresh_values(g, static_cast<int>(values.size()));
    auto replay = std::make_shared<Replay>();
    std::vector<int> fresh_index(values.size(), -1);
    for (int a = 0; a < g.arguments; ++a) {
      fresh_index[a] = static_cast<int>(replay->fresh.size());
      replay->fresh.push_back({a, -1, 0, -1});
    }
    for (size_t n = 0; n < g.nodes.size(); ++n) {
      const TapeNode& node = g.nodes[n];
      for (size_t j = 0; j < node.shapes.size(); ++j) {
        const int v = node.first_output + static_cast<int>(j);
        if (!fresh[v]) continue;
        fresh_index[v] = static_cast<int>(replay->fresh.size());
        const int input = node.view ? fresh_index[node.inputs[0]] : -1;
        replay->fresh.push_back({-1, static_cast<int>(n), static_cast<int>(j), input});
      }
    }
    for (int v : g.outputs) replay->output_fresh.push_back(fresh_index[v]);
    int64_t kept_bytes = 0;
    for (size_t v = g.first_node_value(); v < values.size(); ++v) {
      if (fresh[v]) continue;
      kept_bytes += static_cast<int64_t>(values[v].nbytes());
      replay->kept.push_back(values[v]);
    }
    if (kept_bytes > kReplayBytes) return;
    size_t next_work = 0;
    for (const TapeNode& node : g.nodes) {
      if (node.view) {
        for (size_t j = 0; j < node.shapes.size(); ++j)
          if (values[node.first_output + j].data_shared_ptr() !=
              values[node.inputs[0]].data_shared_ptr())
            return;
        continue;
      }
      if (next_work == work.size()) return;
      const RecordedWork& w = work[next_work++];
      if (w.in.size() != node.inputs.size() || w.out.size() != node.shapes.size()) return;
      std::vector<Replay::Slot> slots;
      for (size_t j = 0; j < node.inputs.size(); ++j)
        if (fresh[node.inputs[j]])
          slots.push_back({false, static_cast<int>(j), fresh_index[node.inputs[j]]});
      for (size_t j = 0; j < node.shapes.size(); ++j)
        if (fresh[node.first_output + j])
          slots.push_back({true, static_cast<int>(j), fresh_index[node.first_output + j]});
      replay->work.push_back(w);
      replay->slots.push_back(std::move(slots));
    }
    if (next_work != work.size()) return;
    if (replay_bytes.fetch_add(kept_bytes) + kept_bytes > kReplayBudget) {
      replay_bytes -= kept_bytes;
      return;
    }
    replay->kept_bytes = kept_bytes;
    std::lock_guard<std::mutex> guard(graph_->lock);
    graph_->replay = std::move(replay);
  }

  // The recorded work over this run's fresh values as one task: the arguments, a new buffer
  // for each fresh value of this module's nodes, the fresh views redone over them here.
  void run_again(const std::shared_ptr<Replay>& replay, const std::vector<mx::array>& inputs,
                 std::vector<mx::array>& outputs) {
    const TapeGraph& g = *graph_;
    std::vector<mx::array> now;  // Replay::fresh's values of this run
    now.reserve(replay->fresh.size());
    std::vector<mx::array> view_out;  // the outputs of the view last redone
    int view_node = -1;
    for (const Replay::Fresh& f : replay->fresh) {
      if (f.argument >= 0) {
        now.push_back(inputs[f.argument]);
        continue;
      }
      const TapeNode& node = g.nodes[f.node];
      if (node.ours) {
        mx::array fresh(node.shapes[f.output], node.dtypes[f.output], nullptr, {});
        fresh.set_data(mx::allocator::malloc(fresh.nbytes()));
        now.push_back(std::move(fresh));
        continue;
      }
      if (view_node != f.node) {  // a view's fresh outputs follow each other: redone once
        std::vector<mx::array> in{now[f.input]};
        view_out = mx::array::make_arrays(node.shapes, node.dtypes, node.primitive, in);
        node.primitive->eval_cpu(in, view_out);
        view_node = f.node;
      }
      now.push_back(view_out[f.output]);
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      const int f = replay->output_fresh[i];
      outputs[i].copy_shared_buffer(f < 0 ? inputs[g.outputs[i]] : now[f]);
    }
    std::vector<mx::array> weak;
    weak.reserve(now.size());
    for (const auto& a : now) weak.push_back(mx::array::unsafe_weak_copy(a));
    mx::cpu::get_command_encoder(stream()).dispatch(
        [replay, weak = std::move(weak), now = std::move(now)]() mutable {
          for (size_t n = 0; n < replay->work.size(); ++n) {
            RecordedWork& w = replay->work[n];
            for (const auto& slot : replay->slots[n])
              (slot.output_side ? w.out : w.in)[slot.index] = weak[slot.fresh];
            w();
          }
        });
  }

  std::shared_ptr<TapeGraph> graph_;
};

// What Python holds: a traced graph (opaque).
struct TraceHandle {
  std::shared_ptr<TapeGraph> graph;
  bool runs_again() const {
    std::lock_guard<std::mutex> guard(graph->lock);
    return graph->replay != nullptr;
  }
  std::vector<std::string> nodes() const {
    std::vector<std::string> names;
    for (const auto& node : graph->nodes)
      names.push_back(std::string(node.primitive->name()) + (node.ours ? "" : "*"));
    return names;
  }
};

// The unevaluated ops between `arguments` and `outputs`, as a tape (as mx.compile does, what the
// ops read that is neither an argument nor an output of another of them is a constant of the
// tape); None when there are none.
std::shared_ptr<TraceHandle> trace(const std::vector<mx::array>& arguments,
                                   const std::vector<mx::array>& outputs) {
  auto graph = std::make_shared<TapeGraph>();
  graph->arguments = static_cast<int>(arguments.size());
  for (const auto& a : arguments) {
    graph->argument_shapes.push_back(a.shape());
    graph->argument_dtypes.push_back(a.dtype());
  }
  std::unordered_map<std::uintptr_t, int> argument_of, constant_of;
  for (size_t i = 0; i < arguments.size(); ++i) argument_of.emplace(arguments[i].id(), i);
  // the nodes in an order the graph allows (each after its inputs' nodes), by depth-first walk
  std::vector<mx::array> order;  // one output of each node
  std::unordered_map<std::uintptr_t, bool> seen;  // primitive id -> finished
  std::vector<std::pair<mx::array, bool>> stack;
  for (const auto& o : outputs) stack.emplace_back(o, false);
  while (!stack.empty()) {
    auto [a, expanded] = stack.back();
    stack.pop_back();
    if (argument_of.count(a.id())) continue;
    if (!a.has_primitive() || a.status() != mx::array::Status::unscheduled) {
      if (!constant_of.count(a.id())) {
        constant_of.emplace(a.id(), static_cast<int>(graph->constants.size()));
        graph->constants.push_back(a);
      }
      continue;
    }
    const auto key = a.primitive_id();
    if (expanded) {
      if (!seen[key]) {
        seen[key] = true;
        order.push_back(a);
      }
      continue;
    }
    if (seen.count(key)) continue;  // expanded already (finished or on the stack below)
    seen[key] = false;
    stack.emplace_back(a, true);
    for (const auto& in : a.inputs()) stack.emplace_back(in, false);
  }
  if (order.empty()) return nullptr;
  for (auto& [id, c] : constant_of) c += graph->arguments;
  int next = graph->arguments + static_cast<int>(graph->constants.size());
  std::unordered_map<std::uintptr_t, int> value_of;
  const auto number = [&](const mx::array& a) {
    if (auto it = argument_of.find(a.id()); it != argument_of.end()) return it->second;
    if (auto it = constant_of.find(a.id()); it != constant_of.end()) return it->second;
    return value_of.at(a.id());
  };
  for (const auto& a : order) {
    TapeNode node{a.primitive_ptr(), {}, {}, {}, next, ours(a.primitive()), false};
    for (const auto& in : a.inputs()) node.inputs.push_back(number(in));
    node.view = !node.ours && a_view(a.primitive()) && node.inputs.size() == 1 &&
        node.inputs[0] >= graph->arguments + static_cast<int>(graph->constants.size());
    for (const auto& o : a.outputs()) {
      node.shapes.push_back(o.shape());
      node.dtypes.push_back(o.dtype());
      value_of.emplace(o.id(), next++);
    }
    graph->nodes.push_back(std::move(node));
  }
  graph->replayable = std::all_of(graph->nodes.begin(), graph->nodes.end(),
                                  [](const TapeNode& n) { return n.ours || n.view; });
  for (const auto& o : outputs) {
    graph->outputs.push_back(number(o));
    graph->output_shapes.push_back(o.shape());
    graph->output_dtypes.push_back(o.dtype());
  }
  return std::make_shared<TraceHandle>(TraceHandle{graph});
}

std::vector<mx::array> run(const TraceHandle& handle, const std::vector<mx::array>& arguments) {
  const TapeGraph& graph = *handle.graph;
  if (static_cast<int>(arguments.size()) != graph.arguments)
    throw std::invalid_argument("run_tape: the tape takes another number of arguments");
  for (int i = 0; i < graph.arguments; ++i)
    if (arguments[i].shape() != graph.argument_shapes[i] ||
        arguments[i].dtype() != graph.argument_dtypes[i])
      throw std::invalid_argument("run_tape: an argument's shape or type is not the traced one");
  std::vector<mx::array> inputs(arguments.begin(), arguments.end());
  inputs.insert(inputs.end(), graph.constants.begin(), graph.constants.end());
  return mx::array::make_arrays(graph.output_shapes, graph.output_dtypes,
                                std::make_shared<Tape>(cpu_stream("run_tape"), handle.graph),
                                inputs);
}

}  // namespace

void bind_tape(nb::module_& m) {
  nb::class_<TraceHandle>(m, "TapeGraph", "A traced block of ops (trace_tape).")
      .def_prop_ro("runs_again", &TraceHandle::runs_again,
                   "Whether its runs repeat its first run's recorded work (only this module's "
                   "ops, small enough to keep what passes between them).")
      .def_prop_ro("nodes", &TraceHandle::nodes, "The names of the ops the block runs, in order (another library's marked *).");
  m.def("trace_tape", &trace, "arguments"_a, "outputs"_a,
        "The unevaluated ops from `arguments` to `outputs` as a graph `run_tape` runs as one op "
        "(what they read that is not an argument kept as a constant, as mx.compile does); None "
        "when there are none.");
  m.def("run_tape", &run, "graph"_a, "arguments"_a,
        "The traced block's outputs for `arguments` (of the traced shapes and types), bit for "
        "bit its ops', as one op: lazy, like any op.");
}

}  // namespace mtpserve
