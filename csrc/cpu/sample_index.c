/* Greedy sample packing for pretrain.data.datasets.build_sample_index (module pretrain.data._index).
 *
 * pack(sizes, doc_idx, budget) -> (first_bytes, end_bytes): int64 arrays (as bytes) of each sample's first
 * sentence and end sentence (exclusive). Sentences join the current sample while its token total stays
 * <= budget; samples never cross a document boundary; empty sentences never start a sample. Exactly the
 * rule of the pure-Python fallback, in two sequential passes (count, then fill) with no Python objects
 * per sentence. sizes: a buffer of int32 or int64; doc_idx: a buffer of int64 (D + 1 offsets).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline int64_t size_at(const Py_buffer *b, Py_ssize_t i) {
  return b->itemsize == 4 ? (int64_t)((const int32_t *)b->buf)[i] : ((const int64_t *)b->buf)[i];
}

/* Walks every document; with out_first == NULL it only counts. Returns the number of samples, -1 on bad input. */
static Py_ssize_t walk(const Py_buffer *sizes, const int64_t *doc, Py_ssize_t num_docs, int64_t budget,
                       int64_t *out_first, int64_t *out_end) {
  Py_ssize_t count = 0;
  const Py_ssize_t n = sizes->len / sizes->itemsize;
  for (Py_ssize_t d = 0; d < num_docs; ++d) {
    const int64_t lo = doc[d], hi = doc[d + 1];
    if (lo < 0 || hi < lo || hi > n) return -1;
    int64_t first = -1, used = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t len = size_at(sizes, i);
      if (len == 0) continue;
      if (used && used + len > budget) {
        if (out_first) { out_first[count] = first; out_end[count] = i; }
        ++count;
        used = 0;
      }
      if (!used) first = i;
      used += len;
    }
    if (used) {
      if (out_first) { out_first[count] = first; out_end[count] = hi; }
      ++count;
    }
  }
  return count;
}

static PyObject *pack(PyObject *self, PyObject *args) {
  Py_buffer sizes, doc;
  long long budget;
  if (!PyArg_ParseTuple(args, "y*y*L", &sizes, &doc, &budget)) return NULL;
  PyObject *result = NULL;
  if ((sizes.itemsize != 4 && sizes.itemsize != 8) || doc.itemsize != 8 || doc.len < 8) {
    PyErr_SetString(PyExc_ValueError, "pack: sizes must be int32/int64 and doc_idx int64 with >= 1 entry");
    goto done;
  }
  const Py_ssize_t num_docs = doc.len / 8 - 1;
  Py_ssize_t count;
  Py_BEGIN_ALLOW_THREADS
  count = walk(&sizes, (const int64_t *)doc.buf, num_docs, budget, NULL, NULL);
  Py_END_ALLOW_THREADS
  if (count < 0) {
    PyErr_SetString(PyExc_ValueError, "pack: doc_idx is not a non-decreasing list of offsets into sizes");
    goto done;
  }
  PyObject *first = PyBytes_FromStringAndSize(NULL, count * 8);
  PyObject *end = PyBytes_FromStringAndSize(NULL, count * 8);
  if (first && end) {
    int64_t *f = (int64_t *)PyBytes_AS_STRING(first), *e = (int64_t *)PyBytes_AS_STRING(end);
    Py_BEGIN_ALLOW_THREADS
    walk(&sizes, (const int64_t *)doc.buf, num_docs, budget, f, e);
    Py_END_ALLOW_THREADS
    result = PyTuple_Pack(2, first, end);
  }
  Py_XDECREF(first);
  Py_XDECREF(end);
done:
  PyBuffer_Release(&sizes);
  PyBuffer_Release(&doc);
  return result;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(sizes, doc_idx, budget) -> (first_bytes, end_bytes), int64"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_index", "Greedy sample packing (C).", -1, methods};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
