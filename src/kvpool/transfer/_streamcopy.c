/* Copy with streaming (non-temporal) stores: the bytes go to memory without first
 * reading the destination's cache lines (no read-for-ownership) and without evicting
 * the writer's working set. A value copied into a shared-memory pool is read later, by
 * another process, so caching its lines on the way in only costs: on this machine a
 * 1 MiB copy into a pool page not touched lately takes 160 us with memcpy and 104-126 us
 * this way (docs/bench.md, "Streaming stores; the TCP request-and-reply ceiling").
 *
 * x86-64 only (SSE2 MOVNTDQ, part of the x86-64 baseline: Intel SDM vol. 2, MOVNTDQ;
 * the SFENCE at the end orders the weakly-ordered stores before anything this thread
 * does next, e.g. telling the master the value is complete). Elsewhere a plain memcpy.
 * The GIL is released during the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>

static void stream_copy(char *dst, const char *src, size_t n)
{
    /* Head: up to the destination's first 64-byte boundary, a plain copy. */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
    _mm_sfence();
}
#define STREAMING 1
#else
static void stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}
#define STREAMING 0
#endif

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination is %zd bytes, source %zd",
                     dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): copy the C-contiguous buffer src into the writable, C-contiguous\n"
     "buffer dst of the same length (bytes) with streaming stores; ValueError when the\n"
     "lengths differ, TypeError when dst is read-only or either is not contiguous."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy",
    "Copies with streaming (non-temporal) stores; see kvpool.transfer.memcopy.", -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
