/* headrace.image._jpeg: decode only the window of a JPEG that a crop needs, resample it
 * straight into a float32 output, in one call that releases the GIL.
 *
 * Why: the Inception-style random resized crop is the hot path of image training. Done
 * in Python it decodes the whole JPEG, wraps it in a Pillow image, resizes, copies back
 * to NumPy and converts to float, about 2.7 ms per 500x375 image. libjpeg-turbo can skip
 * the scanlines above the window without colour conversion or upsampling
 * (jpeg_skip_scanlines), decode only the iMCU columns that cover it (jpeg_crop_scanline)
 * and stop after its last row; the antialiased bilinear resample then runs row by row
 * as the decoder hands rows over, with the flip and the scale/normalisation fused into
 * the last pass. Without the GIL, threads of one process use every core.
 *
 * The resample is Pillow's (precompute_coeffs with the bilinear filter: the triangle
 * kernel widened by the downscale factor when `antialias`), kept in float rather than
 * rounded to uint8, so the result is within one level of the Pillow path it replaces.
 *
 * The decode matches tf.io.decode_jpeg's defaults (fast integer IDCT, fancy upsampling)
 * and simplejpeg's strict mode: a libjpeg warning (corrupt or truncated data) is an
 * error. A file that lacks its end-of-image marker is decoded to the end (so truncation
 * is seen even below the window); a complete one is abandoned after the window.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

typedef float v4f __attribute__((vector_size(16)));

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int strict;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void on_error(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    if (level < 0) { /* a warning: corrupt data the decoder papered over */
        if (err->strict) {
            (*cinfo->err->format_message)(cinfo, err->message);
            longjmp(err->jump, 1);
        }
        cinfo->err->num_warnings++;
    }
}

/* One axis of the resample: for each output index its first input index, its tap count
 * and `ksize` weights (Pillow's precompute_coeffs, bilinear filter). */
typedef struct {
    int *first;
    int *count;
    float *weights;
    int ksize;
    int lo, hi; /* the input range [lo, hi) every output reads */
} Axis;

static void axis_free(Axis *axis) {
    free(axis->first);
    free(axis->count);
    free(axis->weights);
}

static int axis_init(Axis *axis, int in_size, double in0, double in1, int out_size,
                     int antialias) {
    double scale = (in1 - in0) / out_size;
    double filterscale = (antialias && scale > 1.0) ? scale : 1.0;
    double support = filterscale; /* the bilinear filter's support is 1 */
    axis->ksize = (int)ceil(support) * 2 + 1;
    axis->first = malloc(sizeof(int) * (size_t)out_size);
    axis->count = malloc(sizeof(int) * (size_t)out_size);
    axis->weights = malloc(sizeof(float) * (size_t)out_size * (size_t)axis->ksize);
    if (!axis->first || !axis->count || !axis->weights) return -1;
    /* antialiased: the box is resampled at its place in the image, the border outputs
     * weighing pixels just outside it; plain bilinear: tf.image.resize of the box's
     * pixels alone (a crop, then a resize), so the taps stop at the box's edges */
    const int bound_lo = antialias ? 0 : (int)floor(in0);
    const int bound_hi = antialias ? in_size : (int)ceil(in1) < in_size ? (int)ceil(in1) : in_size;
    axis->lo = in_size;
    axis->hi = 0;
    for (int i = 0; i < out_size; i++) {
        double center = in0 + (i + 0.5) * scale;
        double inv = 1.0 / filterscale;
        int xmin = (int)(center - support + 0.5);
        int xmax = (int)(center + support + 0.5);
        if (xmin < bound_lo) xmin = bound_lo;
        if (xmax > bound_hi) xmax = bound_hi;
        if (xmin >= bound_hi) xmin = bound_hi - 1;
        if (xmax <= xmin) xmax = xmin + 1;
        int n = xmax - xmin;
        if (n > axis->ksize) n = axis->ksize;
        float *k = axis->weights + (size_t)i * (size_t)axis->ksize;
        double total = 0.0;
        for (int x = 0; x < n; x++) {
            double t = fabs((x + xmin - center + 0.5) * inv);
            total += t < 1.0 ? 1.0 - t : 0.0;
        }
        for (int x = 0; x < n; x++) {
            double t = fabs((x + xmin - center + 0.5) * inv);
            k[x] = (float)(total != 0.0 ? (t < 1.0 ? 1.0 - t : 0.0) / total : 0.0);
        }
        axis->first[i] = xmin;
        axis->count[i] = n;
        if (xmin < axis->lo) axis->lo = xmin;
        if (xmin + n > axis->hi) axis->hi = xmin + n;
    }
    return 0;
}

typedef struct {
    /* inputs */
    const unsigned char *data;
    size_t size;
    double top, left, bottom, right; /* the box, in the scaled image's pixels */
    int out_h, out_w, channels, denom, antialias, flip, strict;
    float mul[4], add[4];
    float *out;             /* the float32 output, or NULL where out_u8 is given */
    unsigned char *out_u8;  /* a uint8 output (rounded, clamped), for plain crops */
    /* scratch, here (not in run_jpeg's frame) so that it survives libjpeg's longjmp */
    Axis rows, cols;
    float *tmp;
    int tmp_owned; /* tmp is this call's own, not the thread's scratch */
    float *wide;   /* one input row's samples as float, 4 of zero padding after */
    float *acc;    /* one output row in float, where the output is uint8 */
    JSAMPLE *line;
    /* outputs */
    int failed; /* 1: bad data or box, 2: unsupported here (use another path), 3: no memory */
    char message[JMSG_LENGTH_MAX + 128];
} Job;

static int has_end_marker(const unsigned char *data, size_t size) {
    while (size > 2 && data[size - 1] == 0) size--; /* zero padding after the marker */
    return size >= 2 && data[size - 2] == 0xFF && data[size - 1] == 0xD9;
}

/* The buffer of row results, reused across calls on one thread: a fresh malloc of this
 * size (about 1 MB for a 224x224 output) is a fresh mmap whose pages the kernel zeroes
 * on first touch, every call, which cost more than the vertical pass. Freed when the
 * thread exits; one larger than SCRATCH_KEEP (2 MiB, so that what a thread keeps
 * outside the pipeline's budget stays small) is allocated for its call alone. */
#define SCRATCH_KEEP ((size_t)2 << 20)

typedef struct {
    float *data;
    size_t size;
} Scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *scratch) {
    free(((Scratch *)scratch)->data);
    free(scratch);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static float *scratch_get(size_t bytes, int *owned) {
    *owned = 1;
    if (bytes > SCRATCH_KEEP) return malloc(bytes);
    pthread_once(&scratch_once, scratch_init);
    Scratch *scratch = pthread_getspecific(scratch_key);
    if (!scratch) {
        scratch = calloc(1, sizeof *scratch);
        if (!scratch || pthread_setspecific(scratch_key, scratch)) {
            free(scratch);
            return malloc(bytes);
        }
    }
    if (scratch->size < bytes) {
        free(scratch->data);
        scratch->data = malloc(bytes);
        scratch->size = scratch->data ? bytes : 0;
    }
    *owned = 0;
    return scratch->data;
}

/* The resample's weights for an input of in_h x in_w and its buffer of row results.
 * Returns -1 (box not inside the image) or -2 (out of memory) with job->message set. */
static int prepare(Job *job, int in_h, int in_w) {
    const double slack = 1e-6;
    if (job->top < -slack || job->left < -slack || job->bottom > in_h + slack ||
        job->right > in_w + slack) {
        snprintf(job->message, sizeof job->message,
                 "the box (%g, %g, %g, %g) is not inside the %dx%d image", job->top, job->left,
                 job->bottom, job->right, in_h, in_w);
        return -1;
    }
    if (axis_init(&job->rows, in_h, job->top, job->bottom, job->out_h, job->antialias) ||
        axis_init(&job->cols, in_w, job->left, job->right, job->out_w, job->antialias)) {
        snprintf(job->message, sizeof job->message, "out of memory for the resample");
        return -2;
    }
    job->tmp = scratch_get(sizeof(float) * (size_t)(job->rows.hi - job->rows.lo) *
                           (size_t)job->out_w * (size_t)job->channels, &job->tmp_owned);
    job->wide = malloc(sizeof(float) *
                       ((size_t)(job->cols.hi - job->cols.lo) * (size_t)job->channels + 4));
    job->acc = job->out_u8 ? malloc(sizeof(float) * (size_t)job->out_w * (size_t)job->channels)
                           : NULL;
    if (!job->tmp || !job->wide || (job->out_u8 && !job->acc)) {
        snprintf(job->message, sizeof job->message, "out of memory for the resample");
        return -2;
    }
    return 0;
}

/* Horizontal pass of input row `r` (an index into the rows the resample reads), whose
 * first sample is column `xoff`. The samples the taps read are widened to float once
 * (a loop the compiler vectorises); each tap of an RGB output is then one 4-lane
 * multiply-add on an unaligned load (the 4th lane reads the next pixel's red, or the
 * zero padding, and is dropped). */
static void horizontal(Job *job, const JSAMPLE *line, int xoff, int r) {
    const Axis *cols = &job->cols;
    const int C = job->channels, out_w = job->out_w;
    const size_t first = (size_t)(cols->lo - xoff) * (size_t)C;
    const size_t count = (size_t)(cols->hi - cols->lo) * (size_t)C;
    float *wide = job->wide;
    for (size_t p = 0; p < count; p++) wide[p] = (float)line[first + p];
    for (size_t p = count; p < count + 4; p++) wide[p] = 0.f;
    float *dst = job->tmp + (size_t)r * (size_t)out_w * (size_t)C;
    for (int j = 0; j < out_w; j++) {
        const float *k = cols->weights + (size_t)j * (size_t)cols->ksize;
        const float *src = wide + (size_t)(cols->first[j] - cols->lo) * (size_t)C;
        float *o = dst + (size_t)(job->flip ? out_w - 1 - j : j) * (size_t)C;
        const int n = cols->count[j];
        if (C == 3) {
            v4f acc = {0.f, 0.f, 0.f, 0.f};
            for (int x = 0; x < n; x++, src += 3) {
                v4f v;
                memcpy(&v, src, sizeof v);
                acc += v * k[x];
            }
            o[0] = acc[0], o[1] = acc[1], o[2] = acc[2];
        } else {
            float s0 = 0.f;
            for (int x = 0; x < n; x++) s0 += k[x] * src[x];
            o[0] = s0;
        }
    }
}

/* Vertical pass into the output, the flip already done, `v * mul + add` fused in. */
static void vertical(Job *job) {
    const Axis *rows = &job->rows;
    const int C = job->channels;
    const size_t stride = (size_t)job->out_w * (size_t)C;
    for (int i = 0; i < job->out_h; i++) {
        const float *k = rows->weights + (size_t)i * (size_t)rows->ksize;
        const float *src = job->tmp + (size_t)(rows->first[i] - rows->lo) * stride;
        float *o = job->out_u8 ? job->acc : job->out + (size_t)i * stride;
        for (size_t p = 0; p < stride; p++) o[p] = 0.f;
        for (int y = 0; y < rows->count[i]; y++, src += stride) {
            const float w = k[y];
            for (size_t p = 0; p < stride; p++) o[p] += w * src[p];
        }
        for (size_t p = 0; p < stride; p += (size_t)C)
            for (int c = 0; c < C; c++) o[p + c] = o[p + c] * job->mul[c] + job->add[c];
        if (job->out_u8) {
            unsigned char *u = job->out_u8 + (size_t)i * stride;
            for (size_t p = 0; p < stride; p++)
                u[p] = o[p] <= 0.f ? 0 : o[p] >= 255.f ? 255 : (unsigned char)(o[p] + 0.5f);
        }
    }
}

static void release(Job *job) {
    axis_free(&job->rows);
    axis_free(&job->cols);
    if (job->tmp_owned) free(job->tmp);
    free(job->wide);
    free(job->acc);
    free(job->line);
}

/* The resample of decoded pixels (h, w, channels) uint8, C-contiguous. */
static void run_pixels(Job *job, const JSAMPLE *pixels, int in_h, int in_w) {
    const int prepared = prepare(job, in_h, in_w);
    if (prepared) {
        job->failed = prepared == -2 ? 3 : 1;
    } else {
        const size_t stride = (size_t)in_w * (size_t)job->channels;
        for (int r = 0; r < job->rows.hi - job->rows.lo; r++)
            horizontal(job, pixels + (size_t)(job->rows.lo + r) * stride, 0, r);
        vertical(job);
    }
    release(job);
}

/* A row of Adobe (inverted) CMYK to RGB in place, as TensorFlow: R = C * K / 255, G and
 * B from M and Y (each pixel's four values are read before its three are written). */
static void cmyk_to_rgb(unsigned char *line, int width) {
    for (int i = 0; i < width; i++) {
        const unsigned c = line[4 * i], m = line[4 * i + 1], y = line[4 * i + 2],
                       k = line[4 * i + 3];
        line[3 * i] = (unsigned char)(c * k / 255);
        line[3 * i + 1] = (unsigned char)(m * k / 255);
        line[3 * i + 2] = (unsigned char)(y * k / 255);
    }
}

/* A decompressor whose errors go to ``err`` (its message kept; warnings fatal when
 * ``strict``). The caller sets ``err->jump`` with setjmp in its own frame next. */
static void create_decoder(struct jpeg_decompress_struct *cinfo, ErrorManager *err,
                           int strict) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->strict = strict;
    err->message[0] = 0;
    jpeg_create_decompress(cinfo);
}

/* Read the header and start decompressing at 1/denom, as TensorFlow's defaults decode
 * (the fast integer IDCT, fancy upsampling), into C channels: 0, or 1 for a colour
 * space TensorFlow refuses or channels the decoder does not give (called after the
 * caller's setjmp: a libjpeg error jumps there). CMYK (or YCCK) comes out as libjpeg's CMYK, for the caller to turn into RGB
 * as TensorFlow does (Adobe's inverted CMYK: R = C * K / 255); RGB only. */
static int start_decoder(struct jpeg_decompress_struct *cinfo, const unsigned char *data,
                         size_t size, int C, int denom, int *cmyk) {
    jpeg_mem_src(cinfo, data, (unsigned long)size);
    jpeg_read_header(cinfo, TRUE);
    *cmyk = cinfo->jpeg_color_space == JCS_CMYK || cinfo->jpeg_color_space == JCS_YCCK;
    if ((*cmyk && C != 3) ||
        (!*cmyk && C == 3 && cinfo->num_components != 1 && cinfo->num_components != 3))
        return 1;
    cinfo->out_color_space = *cmyk ? JCS_CMYK : C == 1 ? JCS_GRAYSCALE : JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)denom;
    cinfo->dct_method = JDCT_IFAST;
    cinfo->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(cinfo);
    return cinfo->output_components != (*cmyk ? 4 : C);
}

/* Decode the window of the JPEG that the resample reads, then resample it. */
static void run_jpeg(Job *job) {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    const int C = job->channels;

    create_decoder(&cinfo, &err, job->strict);
    if (setjmp(err.jump)) {
        job->failed = 1;
        snprintf(job->message, sizeof job->message, "%s", err.message);
        goto done;
    }
    int cmyk;
    if (start_decoder(&cinfo, job->data, job->size, C, job->denom, &cmyk)) {
        job->failed = 2;
        goto done;
    }
    const int in_h = (int)cinfo.output_height, in_w = (int)cinfo.output_width;
    const int prepared = prepare(job, in_h, in_w);
    if (prepared) {
        job->failed = prepared == -2 ? 3 : 1;
        goto done;
    }
    /* one iMCU column of margin each side: fancy upsampling treats the window's edges as
     * the image's, so the columns next to them differ from a whole decode's */
    const int margin = cinfo.max_h_samp_factor * cinfo.min_DCT_scaled_size;
    const int lo = job->cols.lo > margin ? job->cols.lo - margin : 0;
    const int hi = job->cols.hi + margin < in_w ? job->cols.hi + margin : in_w;
    JDIMENSION xoff = (JDIMENSION)lo, width = (JDIMENSION)(hi - lo);
    if (lo > 0 || hi < in_w) jpeg_crop_scanline(&cinfo, &xoff, &width);
    job->line = malloc((size_t)width * (size_t)cinfo.output_components);
    if (!job->line) {
        job->failed = 3;
        snprintf(job->message, sizeof job->message, "out of memory for the window");
        goto done;
    }
    if (job->rows.lo > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)job->rows.lo);
    for (int r = 0; r < job->rows.hi - job->rows.lo; r++) {
        JSAMPROW row = job->line;
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
            job->failed = 1;
            snprintf(job->message, sizeof job->message, "the decoder stopped at row %d of %d",
                     job->rows.lo + r, in_h);
            goto done;
        }
        if (cmyk) cmyk_to_rgb(job->line, (int)width);
        horizontal(job, job->line, (int)xoff, r);
    }
    if (cinfo.output_scanline < cinfo.output_height && !has_end_marker(job->data, job->size)) {
        /* no end marker: decode on, so that a truncated file fails as it does decoded
         * whole (skipping the last row too would mark the image done unread) */
        if (cinfo.output_height - cinfo.output_scanline > 1)
            jpeg_skip_scanlines(&cinfo, cinfo.output_height - cinfo.output_scanline - 1);
        JSAMPROW row = job->line;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    if (cinfo.output_scanline < cinfo.output_height) {
        jpeg_abort_decompress(&cinfo);
    } else {
        jpeg_finish_decompress(&cinfo);
    }
    vertical(job);
done:
    jpeg_destroy_decompress(&cinfo);
    release(job);
}

/* A whole image at scale 1/denom, written straight into `out` (out_h x out_w x C
 * uint8, C-contiguous): the scanlines land in their rows of the output, with no
 * intermediate image and no resample. Failure codes as run_jpeg's. */
typedef struct {
    const unsigned char *data;
    size_t size;
    unsigned char *out;
    int out_h, out_w, channels, denom, strict;
    JSAMPLE *line; /* CMYK only: one row of four samples, converted into the output */
    int failed;
    char message[JMSG_LENGTH_MAX + 128];
} Whole;

static void run_whole(Whole *job) {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    const int C = job->channels;

    create_decoder(&cinfo, &err, job->strict);
    if (setjmp(err.jump)) {
        job->failed = 1;
        snprintf(job->message, sizeof job->message, "%s", err.message);
        goto done;
    }
    int cmyk;
    if (start_decoder(&cinfo, job->data, job->size, C, job->denom, &cmyk)) {
        job->failed = 2;
        goto done;
    }
    if ((int)cinfo.output_height != job->out_h || (int)cinfo.output_width != job->out_w) {
        job->failed = 1;
        snprintf(job->message, sizeof job->message,
                 "the header says %dx%d at scale 1/%d, the decoder produced %ux%u", job->out_h,
                 job->out_w, job->denom, cinfo.output_height, cinfo.output_width);
        goto done;
    }
    const size_t stride = (size_t)job->out_w * (size_t)C;
    if (cmyk) {
        job->line = malloc((size_t)job->out_w * 4);
        if (!job->line) {
            job->failed = 3;
            snprintf(job->message, sizeof job->message, "out of memory for a row");
            goto done;
        }
    }
    while (cinfo.output_scanline < cinfo.output_height) {
        const JDIMENSION at = cinfo.output_scanline;
        JSAMPROW rows[16];
        JDIMENSION want = cinfo.output_height - at < 16 ? cinfo.output_height - at : 16;
        if (cmyk) want = 1;
        for (JDIMENSION r = 0; r < want; r++)
            rows[r] = cmyk ? job->line : job->out + (size_t)(at + r) * stride;
        const JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want);
        if (got == 0) {
            job->failed = 1;
            snprintf(job->message, sizeof job->message, "the decoder stopped at row %u of %d",
                     at, job->out_h);
            goto done;
        }
        if (cmyk) {
            cmyk_to_rgb(job->line, job->out_w);
            memcpy(job->out + (size_t)at * stride, job->line, stride);
        }
    }
    jpeg_finish_decompress(&cinfo);
done:
    jpeg_destroy_decompress(&cinfo);
    free(job->line);
}

/* uint8 samples of any strides (negative ones included: a flipped view) to float32
 * `v * mul` in C order: one pass, where NumPy's cast-and-multiply of a mirrored image
 * walks three samples per inner loop. The product of the float32 of the sample and the
 * float32 `mul` is rounded once, as astype(float32) then multiply rounds it. */
static void scale_strided(const unsigned char *src, const Py_ssize_t *shape,
                          const Py_ssize_t *strides, int ndim, float **out, float mul) {
    if (ndim == 1) {
        float *o = *out;
        const Py_ssize_t n = shape[0], step = strides[0];
        if (step == 1) {
            for (Py_ssize_t i = 0; i < n; i++) o[i] = (float)src[i] * mul;
        } else {
            for (Py_ssize_t i = 0; i < n; i++) o[i] = (float)src[i * step] * mul;
        }
        *out += n;
        return;
    }
    if (ndim == 2 && strides[1] == 1 && (strides[0] == shape[1] || strides[0] == -shape[1])) {
        /* a row of pixels, mirrored or not: its samples are one contiguous run, scaled
         * in a loop the compiler vectorises, then (mirrored) the pixels swapped end for
         * end in place */
        float *o = *out;
        const Py_ssize_t n = shape[0], c = shape[1], count = n * c;
        const unsigned char *first = strides[0] > 0 ? src : src - (n - 1) * c;
        for (Py_ssize_t i = 0; i < count; i++) o[i] = (float)first[i] * mul;
        if (strides[0] < 0 && n > 1 && c == 3) {
            for (Py_ssize_t i = 0, j = n - 1; i < j; i++, j--) {
                float a[3], b[3];
                memcpy(a, o + i * 3, sizeof a);
                memcpy(b, o + j * 3, sizeof b);
                memcpy(o + i * 3, b, sizeof b);
                memcpy(o + j * 3, a, sizeof a);
            }
        } else if (strides[0] < 0 && n > 1) {
            for (Py_ssize_t i = 0, j = n - 1; i < j; i++, j--) {
                for (Py_ssize_t k = 0; k < c; k++) {
                    const float t = o[i * c + k];
                    o[i * c + k] = o[j * c + k];
                    o[j * c + k] = t;
                }
            }
        }
        *out = o + count;
        return;
    }
    for (Py_ssize_t i = 0; i < shape[0]; i++)
        scale_strided(src + i * strides[0], shape + 1, strides + 1, ndim - 1, out, mul);
}

static int read_floats(PyObject *seq, float *dst, int n, const char *name) {
    PyObject *fast = PySequence_Fast(seq, name);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d values", name, n);
        Py_DECREF(fast);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        dst[i] = (float)PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* The arguments both entry points share: out, box, (out_h, out_w, channels), antialias,
 * flip, mul, add. Returns 0, or -1 with a Python error set. */
static int fill_job(Job *job, Py_buffer *out, double box[4], int out_h, int out_w, int channels,
                    int antialias, int flip, PyObject *mul, PyObject *add) {
    if (channels != 1 && channels != 3) {
        PyErr_SetString(PyExc_ValueError, "channels must be 1 or 3");
        return -1;
    }
    const Py_ssize_t values = (Py_ssize_t)out_h * out_w * channels;
    if (out_h <= 0 || out_w <= 0 || (out->len != values * 4 && out->len != values)) {
        PyErr_SetString(PyExc_ValueError, "out must hold h * w * channels float32 or uint8");
        return -1;
    }
    if (!(box[2] > box[0]) || !(box[3] > box[1])) {
        PyErr_SetString(PyExc_ValueError, "empty box");
        return -1;
    }
    if (read_floats(mul, job->mul, channels, "mul") || read_floats(add, job->add, channels, "add"))
        return -1;
    job->top = box[0], job->left = box[1], job->bottom = box[2], job->right = box[3];
    job->out_h = out_h, job->out_w = out_w, job->channels = channels;
    job->antialias = antialias, job->flip = flip;
    /* uint8 (rounded, clamped): a crop, without a float image 4 times its size */
    if (out->len == values)
        job->out_u8 = out->buf;
    else
        job->out = out->buf;
    return 0;
}

PyDoc_STRVAR(crop_resize_doc,
"crop_resize(data, out, box, shape, denom, antialias, flip, mul, add, strict) -> bool\n\n"
"Decode the part of JPEG `data` that the bilinear resample of `box` (top, left, bottom,\n"
"right in the pixels of the image decoded at scale 1/denom) reads, and write the\n"
"resample into `out` (C-contiguous float32 or uint8 of `shape` (h, w, channels); uint8\n"
"is rounded and clamped), mirrored\n"
"left-right if `flip`, each channel c mapped to v * mul[c] + add[c]. Returns False when\n"
"this decoder does not handle the image (CMYK to one channel): use another path (a\n"
"CMYK JPEG decodes to RGB as TensorFlow's, R = C * K / 255). Raises ValueError\n"
"with libjpeg's message for corrupt data (with `strict`, warnings included) or a box\n"
"outside the image, MemoryError when the scratch buffers cannot be allocated.");

static PyObject *crop_resize(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    double box[4];
    int denom, antialias, flip, strict, out_h, out_w, channels;
    PyObject *mul, *add, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*w*(dddd)(iii)ippOOp", &data, &out, &box[0], &box[1],
                          &box[2], &box[3], &out_h, &out_w, &channels, &denom, &antialias,
                          &flip, &mul, &add, &strict))
        return NULL;
    Job job;
    memset(&job, 0, sizeof job);
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8");
    } else if (!fill_job(&job, &out, box, out_h, out_w, channels, antialias, flip, mul, add)) {
        job.data = data.buf;
        job.size = (size_t)data.len;
        job.denom = denom;
        job.strict = strict;
        Py_BEGIN_ALLOW_THREADS
        run_jpeg(&job);
        Py_END_ALLOW_THREADS
        if (job.failed == 1 || job.failed == 3)
            PyErr_SetString(job.failed == 1 ? PyExc_ValueError : PyExc_MemoryError, job.message);
        else
            result = PyBool_FromLong(job.failed == 0);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(resample_doc,
"resample(pixels, in_shape, out, box, shape, antialias, flip, mul, add) -> None\n\n"
"crop_resize's resample of decoded pixels: C-contiguous uint8 of `in_shape`\n"
"(h, w, channels), the same filter, flip and mapping, so that a crop of encoded bytes\n"
"and of their decoded pixels give the same values.");

static PyObject *resample(PyObject *self, PyObject *args) {
    Py_buffer pixels, out;
    double box[4];
    int in_h, in_w, in_c, antialias, flip, out_h, out_w, channels;
    PyObject *mul, *add, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*(iii)w*(dddd)(iii)ppOO", &pixels, &in_h, &in_w, &in_c, &out,
                          &box[0], &box[1], &box[2], &box[3], &out_h, &out_w, &channels,
                          &antialias, &flip, &mul, &add))
        return NULL;
    Job job;
    memset(&job, 0, sizeof job);
    if (in_c != channels || in_h <= 0 || in_w <= 0 ||
        pixels.len != (Py_ssize_t)in_h * in_w * in_c) {
        PyErr_SetString(PyExc_ValueError, "pixels must hold in_shape uint8 of out's channels");
    } else if (!fill_job(&job, &out, box, out_h, out_w, channels, antialias, flip, mul, add)) {
        Py_BEGIN_ALLOW_THREADS
        run_pixels(&job, pixels.buf, in_h, in_w);
        Py_END_ALLOW_THREADS
        if (job.failed) {
            PyErr_SetString(job.failed == 3 ? PyExc_MemoryError : PyExc_ValueError, job.message);
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&pixels);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(decode_doc,
"decode(data, out, shape, denom, strict) -> bool\n\n"
"Decode JPEG `data` whole at scale 1/denom into `out` (C-contiguous uint8 of `shape`\n"
"(h, w, channels), channels 1 or 3), TensorFlow's defaults (fast integer IDCT, fancy\n"
"upsampling), without the GIL. Returns False when this decoder does not handle the\n"
"image (CMYK to one channel); raises ValueError with libjpeg's message for corrupt\n"
"data (with `strict`, warnings included) or a size other than `shape`.");

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    Whole job;
    memset(&job, 0, sizeof job);
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*w*(iii)ip", &data, &out, &job.out_h, &job.out_w,
                          &job.channels, &job.denom, &job.strict))
        return NULL;
    if (job.denom != 1 && job.denom != 2 && job.denom != 4 && job.denom != 8) {
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8");
    } else if ((job.channels != 1 && job.channels != 3) || job.out_h <= 0 || job.out_w <= 0 ||
               out.len != (Py_ssize_t)job.out_h * job.out_w * job.channels) {
        PyErr_SetString(PyExc_ValueError, "out must hold h * w * channels uint8, channels 1 or 3");
    } else {
        job.data = data.buf;
        job.size = (size_t)data.len;
        job.out = out.buf;
        Py_BEGIN_ALLOW_THREADS
        run_whole(&job);
        Py_END_ALLOW_THREADS
        if (job.failed == 1 || job.failed == 3)
            PyErr_SetString(job.failed == 1 ? PyExc_ValueError : PyExc_MemoryError, job.message);
        else
            result = PyBool_FromLong(job.failed == 0);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(to_float_doc,
"to_float(src, out, mul) -> None\n\n"
"`out` (C-contiguous float32, as many values as `src`) = float32(src) * float32(mul),\n"
"`src` uint8 of any shape and strides (a crop, a mirrored view), without the GIL.");

static PyObject *to_float(PyObject *self, PyObject *args) {
    PyObject *src_obj;
    Py_buffer src, out;
    double mul;
    if (!PyArg_ParseTuple(args, "Ow*d", &src_obj, &out, &mul)) return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.itemsize != 1 || (src.format && strcmp(src.format, "B") != 0)) {
        PyErr_SetString(PyExc_ValueError, "src must be uint8");
    } else if (out.len != src.len * 4) {
        PyErr_SetString(PyExc_ValueError, "out must hold as many float32 as src has values");
    } else {
        float *o = out.buf;
        const float m = (float)mul;
        Py_BEGIN_ALLOW_THREADS
        if (src.ndim == 0)
            o[0] = (float)((const unsigned char *)src.buf)[0] * m;
        else if (src.len > 0)
            scale_strided(src.buf, src.shape, src.strides, src.ndim, &o, m);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"crop_resize", crop_resize, METH_VARARGS, crop_resize_doc},
    {"resample", resample, METH_VARARGS, resample_doc},
    {"decode", decode, METH_VARARGS, decode_doc},
    {"to_float", to_float, METH_VARARGS, to_float_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "headrace.image._jpeg",
    "Windowed JPEG decode + resample in C (libjpeg-turbo), GIL released.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
