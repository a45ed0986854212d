/* weightsync's streaming copy: a host copy whose stores bypass the cache (non-temporal stores).
 *
 * Why: a bucket piece or a model tensor is written once and not read back by this core soon. An ordinary copy
 * (libc memmove below its non-temporal threshold, about 99 MiB here) first reads every destination line into the
 * cache, then writes it back: three memory transfers per byte copied. Non-temporal stores make it two, which on a
 * memory-bound host is most of a copy's time (measured here: 7 GB/s for memmove in 256 KiB pieces, 10 GB/s this way).
 *
 * Loaded through ctypes (no Python API; see weightsync.core.tensors):
 * - weightsync_stream_copy(destination, source, nbytes): memmove's contract except the return value. Small or
 *   overlapping copies, and CPUs without SSE2/AVX2 code here, go to memmove;
 * - weightsync_copy_batch(...), weightsync_copy_columns(...): many small copies in one call (below);
 * - weightsync_stream_copy_kind(): which path large copies take, 2 AVX2, 1 SSE2, 0 memmove;
 * - weightsync_stream_copy_abi(): the version of these signatures.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define WEIGHTSYNC_STREAM_MIN 4096 /* below this, memmove's cached copy is as fast and keeps the bytes cached */
#define WEIGHTSYNC_STREAM_COPY_ABI 3 /* bumped with any change of these functions' signatures or meaning */

/* The Python side refuses a library built from another version of this file (a stale in-place build). */
int weightsync_stream_copy_abi(void) { return WEIGHTSYNC_STREAM_COPY_ABI; }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx2"))) static void copy_avx2(unsigned char *d, const unsigned char *s, size_t blocks) {
    for (size_t i = 0; i < blocks; i++, s += 128, d += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
    }
}

static void copy_sse2(unsigned char *d, const unsigned char *s, size_t blocks) {
    for (size_t i = 0; i < blocks; i++, s += 128, d += 128) {
        for (int lane = 0; lane < 128; lane += 16) {
            _mm_stream_si128((__m128i *)(d + lane), _mm_loadu_si128((const __m128i *)(s + lane)));
        }
    }
}

static int kind = -1;

int weightsync_stream_copy_kind(void) {
    if (kind < 0) {
        __builtin_cpu_init();
        kind = __builtin_cpu_supports("avx2") ? 2 : 1;
    }
    return kind;
}

void weightsync_stream_copy(void *destination, const void *source, size_t nbytes) {
    unsigned char *d = destination;
    const unsigned char *s = source;
    uintptr_t gap = (uintptr_t)d > (uintptr_t)s ? (uintptr_t)d - (uintptr_t)s : (uintptr_t)s - (uintptr_t)d;
    if (nbytes < WEIGHTSYNC_STREAM_MIN || gap < nbytes) {
        memmove(d, s, nbytes);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)d & 63); /* the streamed part starts on a cache line */
    memcpy(d, s, head);
    d += head;
    s += head;
    nbytes -= head;
    size_t blocks = nbytes / 128;
    if (weightsync_stream_copy_kind() == 2) {
        copy_avx2(d, s, blocks);
    } else {
        copy_sse2(d, s, blocks);
    }
    _mm_sfence(); /* the streamed stores are visible before anything this thread stores next (a ready flag) */
    memcpy(d + blocks * 128, s + blocks * 128, nbytes % 128);
}

#else

int weightsync_stream_copy_kind(void) { return 0; }

void weightsync_stream_copy(void *destination, const void *source, size_t nbytes) {
    memmove(destination, source, nbytes);
}

#endif

/* Many small copies in one call, one call from Python instead of one per tensor: entries holds count
 * (destination offset, source offset, nbytes) triples, copied from source_base + source offset to destination_base +
 * destination offset (the ranges of one batch never overlap). A sender passes its bucket as the destination base and
 * absolute source addresses; a receiver the reverse, with stream set: its destinations (model tensors) are not read
 * back, so they are written like weightsync_stream_copy's. */
void weightsync_copy_batch(const uint64_t *entries, size_t count, uint64_t destination_base, uint64_t source_base,
                           int stream) {
    for (size_t i = 0; i < count; i++, entries += 3) {
        void *destination = (void *)(uintptr_t)(destination_base + entries[0]);
        const void *source = (const void *)(uintptr_t)(source_base + entries[1]);
        size_t nbytes = (size_t)entries[2];
        if (nbytes == 0) {
            continue; /* an empty tensor's address may be null */
        }
        if (stream) {
            weightsync_stream_copy(destination, source, nbytes);
        } else {
            memcpy(destination, source, nbytes);
        }
    }
}

/* The same with the triples as three columns, a receiver's layout: absolute destination addresses, source offsets
 * from source_base (its bucket), sizes; every destination streamed. */
void weightsync_copy_columns(const uint64_t *destinations, const uint64_t *sources, const uint64_t *sizes, size_t count,
                             uint64_t source_base) {
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] != 0) {
            weightsync_stream_copy((void *)(uintptr_t)destinations[i],
                                   (const void *)(uintptr_t)(source_base + sources[i]), (size_t)sizes[i]);
        }
    }
}
