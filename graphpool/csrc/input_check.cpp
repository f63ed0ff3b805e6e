// The hot path of GraphPool.run in C++: check a step's inputs against their declarations and write the
// step's ring-table row ([real_bs, data_ptr...]) in one call, once every input fits. In Python the same
// work costs ~0.5 us per input (five attribute calls each); here it is a few nanoseconds. It never raises:
// it returns the real batch size, or -(i + 1) for the first input i that does not fit, and Python's
// validation then raises the typed error that says why (so the rules and messages live in one place).
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <limits>
#include <vector>

namespace {

struct InputChecker {
  std::vector<py::object> names;            // interned Python strings, looked up in the kwargs dict
  std::vector<at::ScalarType> dtypes;
  std::vector<std::vector<int64_t>> trailing;
  std::vector<bool> per_token;
  int64_t device_index;                     // -1: CPU
  int64_t bs_index;                         // the input the real batch size is read from
  int64_t static_start, static_end;         // the memory of every static buffer: inputs must not overlap it
  std::vector<int64_t> own_start;           // ... except each input's own buffer from row 0 (a copy onto itself)
  mutable std::vector<int64_t> pointers;    // scratch: the row is written only once every input fits

  InputChecker(std::vector<std::string> names_, std::vector<at::ScalarType> dtypes_,
               std::vector<std::vector<int64_t>> trailing_, std::vector<bool> per_token_,
               int64_t device_index_, int64_t bs_index_, int64_t static_start_, int64_t static_end_,
               std::vector<int64_t> own_start_)
      : dtypes(std::move(dtypes_)), trailing(std::move(trailing_)), per_token(std::move(per_token_)),
        device_index(device_index_), bs_index(bs_index_), static_start(static_start_), static_end(static_end_),
        own_start(std::move(own_start_)) {
    for (auto& n : names_) names.push_back(py::reinterpret_steal<py::object>(PyUnicode_InternFromString(n.c_str())));
  }

  // Returns the real batch size (and, when row_address != 0, writes row[0] = real_bs and row[1 + i] =
  // data_ptr of input i), or -(i + 1) for the first input i that is missing or does not fit, or -(n + 2)
  // when the batch is larger than max_bs (no graph serves it: the pool's miss policy decides, and a step
  // it refuses must not have overwritten the row of a step staged before it). Nothing written then.
  int64_t check(py::dict inputs, int64_t tokens_per_seq, int64_t row_address, int64_t max_bs) const {
    const int64_t n = static_cast<int64_t>(names.size());
    if (static_cast<int64_t>(PyDict_Size(inputs.ptr())) != n) return -(n + 1);
    int64_t real_bs = -1;
    pointers.resize(n);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = (k == 0) ? bs_index : (k <= bs_index ? k - 1 : k);  // the batch-size input first
      PyObject* obj = PyDict_GetItem(inputs.ptr(), names[i].ptr());
      if (obj == nullptr || !THPVariable_Check(obj)) return -(i + 1);
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (t.layout() != c10::kStrided || t.is_nested()) return -(i + 1);  // sparse or nested: no flat rows
      const auto sizes = t.sizes();
      if (sizes.size() != trailing[i].size() + 1) return -(i + 1);
      if (real_bs < 0) {
        real_bs = per_token[i] ? sizes[0] / tokens_per_seq : sizes[0];
        if (real_bs < 1) return -(i + 1);
        if (real_bs > max_bs) return -(n + 2);
      }
      if (sizes[0] != (per_token[i] ? real_bs * tokens_per_seq : real_bs)) return -(i + 1);
      for (size_t d = 0; d < trailing[i].size(); ++d)
        if (sizes[d + 1] != trailing[i][d]) return -(i + 1);
      if (t.scalar_type() != dtypes[i] || !t.is_contiguous()) return -(i + 1);
      if (t.is_conj() || t.is_neg()) return -(i + 1);  // lazy views: the staging kernel copies raw memory
      if (device_index < 0 ? !t.is_cpu() : (!t.is_cuda() || t.get_device() != device_index)) return -(i + 1);
      const int64_t p = reinterpret_cast<int64_t>(t.data_ptr());
      // Staging reads this memory while it writes the static buffers: any overlap but a copy onto itself races.
      if (p < static_end && p + t.numel() * static_cast<int64_t>(t.element_size()) > static_start && p != own_start[i])
        return -(i + 1);
      pointers[i] = p;
    }
    if (row_address != 0) {
      int64_t* row = reinterpret_cast<int64_t*>(row_address);
      row[0] = real_bs;
      for (int64_t i = 0; i < n; ++i) row[1 + i] = pointers[i];
    }
    return real_bs;
  }
};

// A run's results as new tensor objects: each shares its view's storage, sizes and strides, but owns its
// metadata, so a caller that changes one result in place (unsqueeze_, t_) never reaches another run's. In
// Python, `map(Tensor.detach, views)` costs ~0.8 us per tensor on the H200's host; this skips the dispatcher.
py::list fresh_views(const py::tuple& views) {
  const Py_ssize_t n = PyTuple_GET_SIZE(views.ptr());
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(views.ptr(), i);
    if (obj == Py_None) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(out.ptr(), i, Py_None);
    } else {
      PyList_SET_ITEM(out.ptr(), i, THPVariable_Wrap(THPVariable_Unpack(obj).variable_data()));
    }
  }
  return out;
}

// The same, as a plain dict of `keys` (a tuple of str) to the new tensors: a flat dict result in one call.
py::dict fresh_dict(const py::tuple& keys, const py::tuple& views) {
  const Py_ssize_t n = PyTuple_GET_SIZE(views.ptr());
  py::dict out;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(views.ptr(), i);
    PyObject* value = THPVariable_Wrap(THPVariable_Unpack(obj).variable_data());
    PyDict_SetItem(out.ptr(), PyTuple_GET_ITEM(keys.ptr(), i), value);
    Py_DECREF(value);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fresh_views", &fresh_views, py::arg("views"));
  m.def("fresh_dict", &fresh_dict, py::arg("keys"), py::arg("views"));
  py::class_<InputChecker>(m, "InputChecker")
      .def(py::init<std::vector<std::string>, std::vector<at::ScalarType>, std::vector<std::vector<int64_t>>,
                    std::vector<bool>, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>>())
      .def("check", &InputChecker::check, py::arg("inputs"), py::arg("tokens_per_seq"), py::arg("row_address"),
           py::arg("max_bs") = std::numeric_limits<int64_t>::max());
}
