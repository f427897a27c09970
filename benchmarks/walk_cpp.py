"""An experiment for issue 17: the graph walk's sweep and structure in C++, to know what a compiled walk would save.

Not part of gradroute (which builds nothing at install or run time): ``benchmarks/walk_time.py --cpp`` builds this
with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja needed; about 25 s once, cached under
``~/.cache/torch_extensions``) and times it next to the Python walk on the same fresh graphs.

``sweep(roots)`` records what the Python walk records for the plan cache's signature, without the freed probe:
node classes (one integer per C++ class), the flat edge list ``j, input_nr``, where each node's edges end, and
which nodes are parameters' ``AccumulateGrad``; returned as one ``bytes`` of int64s per list (compared with ``==``,
one ``memcmp``). ``bare(roots)`` only collects the nodes: the floor of any walk, in C++. Neither makes a Python
object per node; a real compiled walk would still need the few nodes the plan starts engine calls from, and the
parameters, as Python objects.
"""

from __future__ import annotations

from typing import Any

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <typeinfo>
#include <unordered_map>

using torch::autograd::Node;

static Node* node_of(PyObject* obj) {
  if (torch::autograd::THPCppFunction_Check(obj)) return ((torch::autograd::THPCppFunction*)obj)->cdata.get();
  if (THPFunction_Check(obj)) return ((THPFunction*)obj)->cdata.get();
  throw std::runtime_error("not an autograd node");
}

static void roots_into(py::list roots, std::unordered_map<Node*, int64_t>& index, std::vector<Node*>& nodes) {
  index.reserve(8192);
  nodes.reserve(8192);
  for (auto r : roots) {
    Node* n = node_of(r.ptr());
    if (index.emplace(n, (int64_t)nodes.size()).second) nodes.push_back(n);
  }
}

static py::bytes as_bytes(const std::vector<int64_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

py::tuple sweep(py::list roots) {
  std::unordered_map<Node*, int64_t> index;
  std::vector<Node*> nodes;
  roots_into(roots, index, nodes);
  std::vector<int64_t> classes, edges, ends, leaves;
  classes.reserve(8192); edges.reserve(32768); ends.reserve(8192);
  for (size_t i = 0; i < nodes.size(); ++i) {
    Node* node = nodes[i];
    classes.push_back((int64_t)(intptr_t)&typeid(*node));
    for (const auto& e : node->next_edges()) {
      Node* f = e.function.get();
      if (!f) continue;
      auto it = index.try_emplace(f, (int64_t)nodes.size());
      if (it.second) nodes.push_back(f);
      edges.push_back(it.first->second);
      edges.push_back(e.input_nr);
    }
    ends.push_back((int64_t)edges.size());
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node)) leaves.push_back((int64_t)i);
  }
  return py::make_tuple(as_bytes(classes), as_bytes(edges), as_bytes(ends), as_bytes(leaves));
}

int64_t bare(py::list roots) {
  std::unordered_map<Node*, int64_t> index;
  std::vector<Node*> nodes;
  roots_into(roots, index, nodes);
  for (size_t i = 0; i < nodes.size(); ++i)
    for (const auto& e : nodes[i]->next_edges())
      if (e.function && index.try_emplace(e.function.get(), (int64_t)nodes.size()).second)
        nodes.push_back(e.function.get());
  return (int64_t)nodes.size();
}
"""


def load() -> Any:
    """The built extension (``sweep``, ``bare``)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "gradroute_walk_experiment", cpp_sources=[_SOURCE], functions=["sweep", "bare"], extra_cflags=["-O2"]
    )
