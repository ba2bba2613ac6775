/* metrale_cli._native: the pack's host fill reads and checks in one pass through the cache.
 *
 * `read_checked` reads a file's bytes straight into a list of writable buffers (the slot spans
 * of tensors that lie end to end in the file) with positional reads of at most `chunk` bytes,
 * and checks each chunk for NaN and infinity as BF16 while it is still in this core's cache,
 * all without the GIL: NumPy's check took two passes over a piece after the read, each a call
 * that hands the GIL to the other fill thread and back (metrale_cli/pool/fill.py).
 * `any_non_finite` is that check on its own, one pass where NumPy takes two.
 *
 * Built by setup.py where the install has a C compiler; metrale_cli/native.py says whether it
 * was, and the callers fall back to os.preadv and NumPy where it was not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

/* BF16 is NaN or infinity when its 8 exponent bits are all set. */
#define EXPONENT 0x7F80u
/* Elements between looks at the running flag: long enough to vectorise, short enough to stop
 * soon after a non-finite value. */
#define BLOCK 4096
/* Iovecs a positional read takes at most here (POSIX guarantees 16; Linux takes 1024). */
#define MAX_IOV 64

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
/* AVX2 where the CPU has it (about twice SSE2's speed here), chosen at load time (an ifunc:
 * glibc's; musl has none, and gets the one build). */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Whether any of the `n` BF16 values at `bytes` (any alignment: each loaded with memcpy, which
 * compiles to plain loads) is NaN or infinity. */
CLONES static int scan(const unsigned char *bytes, size_t n)
{
    for (size_t lo = 0; lo < n; lo += BLOCK) {
        size_t hi = n - lo < BLOCK ? n : lo + BLOCK;
        uint16_t seen = 0;
        for (size_t i = lo; i < hi; i++) {
            uint16_t bits;
            memcpy(&bits, bytes + 2 * i, sizeof bits);
            seen |= (uint16_t)((bits & EXPONENT) == EXPONENT);
        }
        if (seen)
            return 1;
    }
    return 0;
}

/* Reads exactly the bytes `iov[0..count)` describe from `fd` at `offset` (a positional read may
 * return less than asked). Returns the bytes read: fewer at the end of the file; -errno on a
 * failed read. */
static long long read_fully(int fd, long long offset, struct iovec *iov, int count)
{
    long long total = 0;
    while (count > 0) {
        ssize_t got = preadv(fd, iov, count, (off_t)(offset + total));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -(long long)errno;
        }
        if (got == 0)
            break;
        total += got;
        while (count > 0 && (size_t)got >= iov->iov_len) {
            got -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return total;
}

/* The bytes of `spans` read from `fd` at `offset` a chunk at a time, each chunk checked once
 * read. Sets `*seen` where a chunk holds a non-finite value; returns as read_fully does. Runs
 * without the GIL. */
static long long fill(int fd, long long offset, const Py_buffer *spans, Py_ssize_t count,
                      long long chunk, int *seen)
{
    struct iovec iov[MAX_IOV], want[MAX_IOV];
    long long done = 0;
    Py_ssize_t span = 0;
    size_t into = 0; /* bytes of spans[span] already read */
    while (span < count) {
        int n = 0;
        long long size = 0;
        while (span < count && size < chunk && n < MAX_IOV) {
            size_t left = (size_t)spans[span].len - into;
            size_t take = (long long)left > chunk - size ? (size_t)(chunk - size) : left;
            iov[n].iov_base = (char *)spans[span].buf + into;
            iov[n].iov_len = take;
            n++;
            size += (long long)take;
            into += take;
            if (into == (size_t)spans[span].len) {
                span++;
                into = 0;
            }
        }
        memcpy(want, iov, sizeof(struct iovec) * (size_t)n); /* read_fully moves its copy on */
        long long got = read_fully(fd, offset + done, want, n);
        if (got < 0)
            return got;
        done += got;
        if (got < size)
            return done; /* the file ended: the caller names the tensor */
        for (int i = 0; !*seen && i < n; i++)
            *seen = scan((const unsigned char *)iov[i].iov_base, iov[i].iov_len / 2);
    }
    return done;
}

static PyObject *read_checked(PyObject *self, PyObject *args)
{
    int fd;
    long long offset, chunk;
    PyObject *spans;
    if (!PyArg_ParseTuple(args, "iLOL", &fd, &offset, &spans, &chunk))
        return NULL;
    if (offset < 0 || chunk < 2 || chunk % 2) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0 and chunk an even count >= 2");
        return NULL;
    }
    /* A tuple of its own, not the caller's list: taking a buffer can run Python code (a
     * class's __buffer__, Python 3.12 on) that empties the list under the loop below. */
    PyObject *items = PySequence_Tuple(spans);
    if (items == NULL)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(items);
    Py_buffer *views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(items);
        return PyErr_NoMemory();
    }
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (; held < count; held++) {
        PyObject *item = PyTuple_GET_ITEM(items, held);
        if (PyObject_GetBuffer(item, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (views[held].len % 2) {
            PyBuffer_Release(&views[held]);
            PyErr_SetString(PyExc_ValueError, "a span checked as BF16 has an odd byte count");
            goto done;
        }
    }
    int seen = 0;
    long long got;
    Py_BEGIN_ALLOW_THREADS
    got = fill(fd, offset, views, count, chunk, &seen);
    Py_END_ALLOW_THREADS
    if (got < 0) {
        errno = (int)-got;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("(LO)", got, seen ? Py_True : Py_False);
done:
    while (held > 0)
        PyBuffer_Release(&views[--held]);
    PyMem_Free(views);
    Py_DECREF(items);
    return result;
}

static PyObject *any_non_finite(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (view.len % 2) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "BF16 bits need an even byte count");
        return NULL;
    }
    int seen;
    Py_BEGIN_ALLOW_THREADS
    seen = scan((const unsigned char *)view.buf, (size_t)view.len / 2);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(seen);
}

static PyMethodDef methods[] = {
    {"read_checked", read_checked, METH_VARARGS,
     "read_checked(fd, offset, spans, chunk) -> (bytes read, non-finite seen)\n\n"
     "The file's bytes from offset on into each writable buffer of spans in turn, read `chunk`\n"
     "bytes at a time, each chunk checked for BF16 NaN or infinity once read.\n"
     "Fewer bytes than the spans hold: the file ended. OSError: a failed read."},
    {"any_non_finite", any_non_finite, METH_O,
     "any_non_finite(bits) -> whether the contiguous BF16 bits hold a NaN or infinity"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "metrale_cli._native",
    "The pack's host fill: reads checked in one pass through the cache (_native.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
