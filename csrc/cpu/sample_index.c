/* Greedy sample packing for pretrain.data.sample_index (module pretrain.data._index).
 *
 * pack(sizes, doc_idx, budget) -> (first_bytes, end_bytes): int64 arrays (as bytes) of each sample's first
 * sentence and end sentence (exclusive). Sentences join the current sample while its token total stays
 * <= budget; samples never cross a document boundary; empty sentences never start a sample. Exactly the
 * rule of the pure-Python fallback, with no Python objects per sentence. sizes: a buffer of int32 or int64;
 * doc_idx: a buffer of int64 (D + 1 offsets).
 *
 * starts(sizes, doc_idx, budget, out, offset) -> (count, last_end): the same samples in one pass, as their
 * first sentences (+ offset) written into a writable contiguous int64 buffer (e.g. a memory-mapped cache file
 * sized for the worst case, one sample per sentence), and the end of the last sample (+ offset; offset when
 * there is none). A sample's end is the next one's first sentence except across skipped empty sentences, which
 * hold no tokens, and at the end of the data, which last_end gives: the cache stores N + 1 starts, half of
 * (first, end) pairs, and is written without counting first.
 *
 * Both take an optional last argument full (default 0): with full != 0, samples run on across document
 * boundaries (packing "full", RoBERTa's FULL-SENTENCES), each boundary between two non-empty sentences of one
 * sample costing one separator token in the budget.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline int64_t size_at(const Py_buffer *b, Py_ssize_t i) {
  return b->itemsize == 4 ? (int64_t)((const int32_t *)b->buf)[i] : ((const int64_t *)b->buf)[i];
}

/* Walks every document; with out_first == NULL it only counts, else writes at most cap samples (+ offset).
 * Returns the number of samples, -1 on bad input, -2 when there are more than cap samples. */
static Py_ssize_t walk(const Py_buffer *sizes, const int64_t *doc, Py_ssize_t num_docs, int64_t budget, int full,
                       int64_t *out_first, int64_t *out_end, int64_t offset, Py_ssize_t cap, int64_t *last_end) {
  Py_ssize_t count = 0;
  const Py_ssize_t n = sizes->len / sizes->itemsize;
  int64_t first = -1, used = 0, sep = 0;
  for (Py_ssize_t d = 0; d < num_docs; ++d) {
    const int64_t lo = doc[d], hi = doc[d + 1];
    if (lo < 0 || hi < lo || hi > n) return -1;
    if (!full) used = 0;
    sep = used ? 1 : 0; /* full: a non-empty sentence of this document after others costs a separator */
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t len = size_at(sizes, i);
      if (len == 0) continue;
      if (used && used + sep + len > budget) {
        if (out_first && count >= cap) return -2;
        if (out_first) out_first[count] = first + offset;
        if (out_end) out_end[count] = i + offset;
        ++count;
        used = 0;
        sep = 0;
      }
      if (!used) first = i;
      used += sep + len;
      sep = 0;
    }
    const int last_doc = d + 1 == num_docs;
    if (used && (!full || last_doc)) {
      if (out_first && count >= cap) return -2;
      if (out_first) out_first[count] = first + offset;
      if (out_end) out_end[count] = hi + offset;
      if (last_end) *last_end = hi + offset;
      ++count;
    }
  }
  return count;
}

static PyObject *pack(PyObject *self, PyObject *args) {
  Py_buffer sizes, doc;
  long long budget;
  int full = 0;
  if (!PyArg_ParseTuple(args, "y*y*L|p", &sizes, &doc, &budget, &full)) return NULL;
  /* Declared before the first goto: torch's BuildExtension compiles this file as C++ too (g++ on the CUDA build),
     where a jump may not cross an initialisation. */
  PyObject *result = NULL, *first = NULL, *end = NULL;
  Py_ssize_t num_docs, count;
  if ((sizes.itemsize != 4 && sizes.itemsize != 8) || doc.itemsize != 8 || doc.len < 8) {
    PyErr_SetString(PyExc_ValueError, "pack: sizes must be int32/int64 and doc_idx int64 with >= 1 entry");
    goto done;
  }
  num_docs = doc.len / 8 - 1;
  Py_BEGIN_ALLOW_THREADS
  count = walk(&sizes, (const int64_t *)doc.buf, num_docs, budget, full, NULL, NULL, 0, 0, NULL);
  Py_END_ALLOW_THREADS
  if (count < 0) {
    PyErr_SetString(PyExc_ValueError, "pack: doc_idx is not a non-decreasing list of offsets into sizes");
    goto done;
  }
  first = PyBytes_FromStringAndSize(NULL, count * 8);
  end = PyBytes_FromStringAndSize(NULL, count * 8);
  if (first && end) {
    int64_t *f = (int64_t *)PyBytes_AS_STRING(first), *e = (int64_t *)PyBytes_AS_STRING(end);
    Py_BEGIN_ALLOW_THREADS
    walk(&sizes, (const int64_t *)doc.buf, num_docs, budget, full, f, e, 0, count, NULL);
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

static int check_inputs(const Py_buffer *sizes, const Py_buffer *doc) {
  if ((sizes->itemsize != 4 && sizes->itemsize != 8) || doc->itemsize != 8 || doc->len < 8) {
    PyErr_SetString(PyExc_ValueError, "sizes must be int32/int64 and doc_idx int64 with >= 1 entry");
    return 0;
  }
  return 1;
}

static PyObject *starts(PyObject *self, PyObject *args) {
  Py_buffer sizes, doc, out;
  long long budget, offset;
  int full = 0;
  if (!PyArg_ParseTuple(args, "y*y*Lw*L|p", &sizes, &doc, &budget, &out, &offset, &full)) return NULL;
  PyObject *result = NULL;
  if (check_inputs(&sizes, &doc)) {
    if (out.itemsize != 8 || !PyBuffer_IsContiguous(&out, 'C')) {
      PyErr_SetString(PyExc_ValueError, "starts: out must be a contiguous int64 buffer");
    } else {
      Py_ssize_t count;
      int64_t last_end = offset;
      Py_BEGIN_ALLOW_THREADS
      count = walk(&sizes, (const int64_t *)doc.buf, doc.len / 8 - 1, budget, full, (int64_t *)out.buf, NULL,
                   offset, out.len / 8, &last_end);
      Py_END_ALLOW_THREADS
      if (count == -1)
        PyErr_SetString(PyExc_ValueError, "starts: doc_idx is not a non-decreasing list of offsets into sizes");
      else if (count == -2)
        PyErr_Format(PyExc_ValueError, "starts: the data packs into more than the %zd samples out holds",
                     out.len / 8);
      else
        result = Py_BuildValue("(nL)", count, (long long)last_end);
    }
  }
  PyBuffer_Release(&sizes);
  PyBuffer_Release(&doc);
  PyBuffer_Release(&out);
  return result;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(sizes, doc_idx, budget[, full]) -> (first_bytes, end_bytes), int64"},
    {"starts", starts, METH_VARARGS,
     "starts(sizes, doc_idx, budget, out, offset[, full]) -> (count, last_end): first sentences (+ offset) into out"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_index", "Greedy sample packing (C).", -1, methods};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
