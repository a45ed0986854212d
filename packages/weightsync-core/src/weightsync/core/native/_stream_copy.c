/* weightsync's streaming copy: a host copy whose stores bypass the cache (non-temporal stores).
 *
 * Why: a bucket piece or a model tensor is written once and not read back by this core soon. An ordinary copy
 * (libc memmove below its non-temporal threshold, about 99 MiB here) first reads every destination line into the
 * cache, then writes it back: three memory transfers per byte copied. Non-temporal stores make it two, which on a
 * memory-bound host is most of a copy's time (measured here: 7 GB/s for memmove in 256 KiB pieces, 10 GB/s this way).
 *
 * Loaded through ctypes (no Python API; see weightsync.core.native):
 * - weightsync_stream_copy(destination, source, nbytes): memmove's contract except the return value. Small or
 *   overlapping copies, and CPUs without SSE2/AVX2 code here, go to memmove;
 * - weightsync_copy_batch(...), weightsync_copy_columns(...): many small copies in one call (below);
 * - weightsync_stream_copy_kind(): which path large copies take, 2 AVX2, 1 SSE2, 0 memmove;
 * - weightsync_delta_encode(...), weightsync_delta_apply(...), weightsync_delta_sum(...): delta updates'
 *   changed units and the keyed sums that verify what a receiver holds (below);
 * - weightsync_stream_copy_abi(): the version of these signatures.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define WEIGHTSYNC_STREAM_MIN 4096 /* below this, memmove's cached copy is as fast and keeps the bytes cached */
#define WEIGHTSYNC_STREAM_COPY_ABI 8 /* bumped with any change of these functions' signatures or meaning */

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

/* Keyed sums (weightsync.core.delta.encoding.bucket_sum): the sum, modulo 2^64, over the 8-byte words of some pieces of
 * memory (little-endian; a piece's last word zero-filled past its end) of
 *     x = word XOR key, (x mod 2^32) * (x div 2^32) + x,
 * where a piece's first word has the key its row gives and each next word the key before plus KEY_STEP. A sum of
 * independent terms: the sender updates it from the words that changed alone, and a receiver computes it in the
 * same pass that applies the changes. */
#define KEY_STEP 0x9E3779B97F4A7C15ull

static inline uint64_t keyed_term(uint64_t word, uint64_t key) {
    uint64_t x = word ^ key;
    return (x & 0xffffffffull) * (x >> 32) + x;
}

/* The word at p, or its first nbytes (below 8) zero-filled. */
static inline uint64_t load_partial(const unsigned char *p, uint64_t nbytes) {
    uint64_t v = 0;
    if (nbytes >= 8) {
        memcpy(&v, p, 8);
        return v;
    }
    for (uint64_t i = 0; i < nbytes; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* 64-byte blocks, two vectors of four words: the same terms, summed in eight lanes. */
__attribute__((target("avx2"))) static uint64_t keyed_blocks_avx2(const unsigned char *p, uint64_t blocks,
                                                                  uint64_t key) {
    __m256i k = _mm256_set_epi64x((long long)(key + 3 * KEY_STEP), (long long)(key + 2 * KEY_STEP),
                                  (long long)(key + KEY_STEP), (long long)key);
    __m256i k2 = _mm256_add_epi64(k, _mm256_set1_epi64x((long long)(4 * KEY_STEP)));
    const __m256i step = _mm256_set1_epi64x((long long)(8 * KEY_STEP));
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (uint64_t i = 0; i < blocks; i++, p += 64) {
        __m256i x = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), k);
        __m256i y = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 32)), k2);
        a = _mm256_add_epi64(a, _mm256_add_epi64(_mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)), x));
        b = _mm256_add_epi64(b, _mm256_add_epi64(_mm256_mul_epu32(y, _mm256_srli_epi64(y, 32)), y));
        k = _mm256_add_epi64(k, step);
        k2 = _mm256_add_epi64(k2, step);
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a, b));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

/* The keyed sum of nbytes at p whose first word has key. */
static uint64_t keyed_sum(const unsigned char *p, uint64_t nbytes, uint64_t key) {
    uint64_t sum = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (weightsync_stream_copy_kind() == 2) {
        uint64_t blocks = nbytes / 64;
        sum = keyed_blocks_avx2(p, blocks, key);
        p += blocks * 64;
        nbytes -= blocks * 64;
        key += blocks * 8 * KEY_STEP;
    }
#endif
    for (; nbytes >= 8; p += 8, nbytes -= 8, key += KEY_STEP) {
        sum += keyed_term(load_partial(p, 8), key);
    }
    if (nbytes > 0) {
        sum += keyed_term(load_partial(p, nbytes), key);
    }
    return sum;
}

/* pieces: count rows of (address, nbytes, key of the first word). Returns their keyed sum. */
uint64_t weightsync_delta_sum(const uint64_t *pieces, size_t count) {
    uint64_t sum = 0;
    for (size_t i = 0; i < count; i++, pieces += 3) {
        sum += keyed_sum((const unsigned char *)(uintptr_t)pieces[0], pieces[1], pieces[2]);
    }
    return sum;
}

/* Delta updates (weightsync.core.delta.encoding). A bucket's pieces are compared with the base version's copy of them in
 * units (a unit is the dtype's element size: 1, 2, 4 or 8 bytes). Each piece is encoded as runs of changed units,
 *     varint run (units, at least 1), varint gap (units since the end of the previous run, or since the piece's
 *     start), then the run's new bytes,
 * and closed by a 0 byte. A varint holds 7 bits per byte, low bits first, the high bit set on every byte but the
 * last. */

static inline uint64_t load_unit(const unsigned char *p, uint64_t unit) {
    switch (unit) {
    case 1: return *p;
    case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static inline uint64_t load_word(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline unsigned char *put_varint(unsigned char *out, uint64_t value) {
    while (value >= 0x80) {
        *out++ = (unsigned char)(value | 0x80);
        value >>= 7;
    }
    *out++ = (unsigned char)value;
    return out;
}

/* The offset of the first unit at or after at (a multiple of unit) where source and base differ, or nbytes: equal
 * bytes are skipped 32, then 8 at a time; a differing word names its first differing byte (little-endian: the lowest
 * set byte of the XOR), rounded down to its unit (every word starts on a unit: unit divides 8). */
static inline uint64_t next_change(const unsigned char *source, const unsigned char *base, uint64_t at,
                                   uint64_t nbytes, uint64_t unit) {
    while (at + 32 <= nbytes) {
        uint64_t x = (load_word(source + at) ^ load_word(base + at)) |
                     (load_word(source + at + 8) ^ load_word(base + at + 8)) |
                     (load_word(source + at + 16) ^ load_word(base + at + 16)) |
                     (load_word(source + at + 24) ^ load_word(base + at + 24));
        if (x != 0) {
            break;
        }
        at += 32;
    }
    while (at + 8 <= nbytes) {
        uint64_t x = load_word(source + at) ^ load_word(base + at);
        if (x != 0) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            return at + (uint64_t)__builtin_ctzll(x) / 8 / unit * unit;
#else
            break;
#endif
        }
        at += 8;
    }
    while (at < nbytes && load_unit(source + at, unit) == load_unit(base + at, unit)) {
        at += unit;
    }
    return at;
}

/* Copies one run of changed units: runs are mostly a unit or two long, where a call to memcpy costs more than the
 * copy. */
static inline void copy_run(unsigned char *to, const unsigned char *from, uint64_t nbytes) {
    switch (nbytes) {
    case 1: *to = *from; return;
    case 2: memcpy(to, from, 2); return;
    case 4: memcpy(to, from, 4); return;
    case 8: memcpy(to, from, 8); return;
    default: memcpy(to, from, nbytes); return;
    }
}

/* Encodes one piece (see weightsync_delta_encode) at *out while it fits in *room; returns 0 once it stopped fitting.
 * An open piece gets no closing byte and *last_end gets where its last run ended. Inlined for each unit, so its
 * unit-sized loads and copies are single instructions. */
static inline __attribute__((always_inline)) int encode_piece(const unsigned char *source, unsigned char *base,
                                                               uint64_t nbytes, uint64_t unit, uint64_t key,
                                                               unsigned char **out, uint64_t *room, int fits,
                                                               uint64_t *changed, uint64_t *adjust, int open,
                                                               uint64_t *last_end, const uint64_t *segments,
                                                               uint64_t *part_changes) {
    unsigned char *p = *out;
    uint64_t at = 0, last = 0, next_word = 0, segment = 0;
    while ((at = next_change(source, base, at, nbytes, unit)) < nbytes) {
        uint64_t start = at;
        do {
            at += unit;
        } while (at < nbytes && load_unit(source + at, unit) != load_unit(base + at, unit));
        uint64_t run = at - start;
        /* The words this run touches change their terms, once each: the source's whole word is the base's once
         * every run is copied (the bytes outside runs are equal). */
        for (uint64_t word = start / 8 > next_word ? start / 8 : next_word; word * 8 < at; word++) {
            uint64_t word_key = key + word * KEY_STEP, left = nbytes - word * 8;
            uint64_t change = keyed_term(load_partial(source + word * 8, left), word_key) -
                              keyed_term(load_partial(base + word * 8, left), word_key);
            *adjust += change;
            if (segments) { /* the parts that hold this word (segments end on words) change their sums too */
                while (segments[2 * segment] <= word * 8) {
                    segment++;
                }
                for (uint64_t mask = segments[2 * segment + 1]; mask; mask &= mask - 1) {
                    part_changes[__builtin_ctzll(mask)] += change;
                }
            }
        }
        next_word = (at + 7) / 8;
        copy_run(base + start, source + start, run);
        *changed += run;
        if (fits) {
            if (*room < run + 21) { /* two varints of at most 10 bytes, and the piece's closing byte */
                fits = 0;
            } else {
                unsigned char *begin = p;
                p = put_varint(p, run / unit);
                p = put_varint(p, (start - last) / unit);
                copy_run(p, source + start, run);
                p += run;
                *room -= (uint64_t)(p - begin);
            }
        }
        last = at;
    }
    *last_end = last;
    if (fits && !open) {
        if (*room < 1) {
            fits = 0;
        } else {
            *p++ = 0;
            *room -= 1;
        }
    }
    *out = p;
    return fits;
}

/* pieces: count rows of (source address, base address, nbytes, unit, key); nbytes is a multiple of unit, and unit
 * one of 1, 2, 4, 8. Compares every source with its base, writes the encoding to out while it fits in capacity
 * bytes, and copies every changed run into the base (so the base then holds the source's bytes, whether or not the
 * encoding fit). Returns the encoding's length, or UINT64_MAX when it did not fit; *changed gets the changed bytes
 * and *sum_change what the bases' keyed sum (key: of a piece's first word) changed by, modulo 2^64. With open_last,
 * the last row is the first part of a piece whose rest another call encodes: it gets no closing byte, and *last_end
 * gets where its last run ended (from the row's start; 0 without runs), which the rest's first gap must count from
 * (weightsync.core.delta.encoding joins the two). With segments (else NULL), the parts' sums too
 * (weightsync.core.delta.parts): per piece a count n, then n (end, mask) pairs that cover it, the ends on its words
 * (from its start, increasing, the last its nbytes); each changed word's term change is added to part_changes[b]
 * for every bit b of its segment's mask. */
uint64_t weightsync_delta_encode(const uint64_t *pieces, size_t count, unsigned char *out, uint64_t capacity,
                                 uint64_t *changed, uint64_t *sum_change, int open_last, uint64_t *last_end,
                                 const uint64_t *segments, uint64_t *part_changes) {
    unsigned char *p = out;
    uint64_t room = capacity, changed_bytes = 0, adjust = 0, last = 0;
    int fits = 1;
    for (size_t i = 0; i < count; i++, pieces += 5) {
        const unsigned char *source = (const unsigned char *)(uintptr_t)pieces[0];
        unsigned char *base = (unsigned char *)(uintptr_t)pieces[1];
        uint64_t nbytes = pieces[2], key = pieces[4];
        int open = open_last && i + 1 == count;
        const uint64_t *pairs = segments ? segments + 1 : NULL;
#define ENCODE_PIECE(UNIT) \
    encode_piece(source, base, nbytes, UNIT, key, &p, &room, fits, &changed_bytes, &adjust, open, &last, pairs, \
                 part_changes)
        switch (pieces[3]) {
        case 1: fits = ENCODE_PIECE(1); break;
        case 2: fits = ENCODE_PIECE(2); break;
        case 4: fits = ENCODE_PIECE(4); break;
        default: fits = ENCODE_PIECE(8); break;
        }
#undef ENCODE_PIECE
        if (segments) {
            segments += 1 + 2 * segments[0];
        }
    }
    *changed = changed_bytes;
    *sum_change = adjust;
    *last_end = last;
    return fits ? (uint64_t)(p - out) : UINT64_MAX;
}

/* Reads one varint at *p (not past end) into *value; -1 for one that is cut off or longer than 64 bits. A value
 * below 128, the common case (a run of a unit or two, a short gap), is one byte. */
static inline __attribute__((always_inline)) int get_varint(const unsigned char **p, const unsigned char *end,
                                                             uint64_t *value) {
    const unsigned char *at = *p;
    if (at < end && *at < 0x80) {
        *value = *at;
        *p = at + 1;
        return 0;
    }
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (at >= end) {
            return -1;
        }
        unsigned char byte = *at++;
        result |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *value = result;
            *p = at;
            return 0;
        }
    }
    return -1;
}

/* Checks an encoding over its pieces (rows of four: destination, nbytes, unit, key): every run inside its piece,
 * nothing left over. 0 when it is well formed, else -1. */
static int check_delta(const unsigned char *delta, uint64_t length, const uint64_t *pieces, size_t count) {
    const unsigned char *p = delta, *end = delta + length;
    for (size_t i = 0; i < count; i++, pieces += 4) {
        uint64_t units = pieces[1] / pieces[2], unit = pieces[2], position = 0;
        for (;;) {
            uint64_t run, gap;
            if (get_varint(&p, end, &run) != 0) {
                return -1;
            }
            if (run == 0) {
                break;
            }
            if (get_varint(&p, end, &gap) != 0 || gap > units - position || run > units - position - gap ||
                (uint64_t)(end - p) < run * unit) {
                return -1;
            }
            p += run * unit;
            position += gap + run;
        }
    }
    return p == end ? 0 : -1;
}

#define SUM_CHUNK 4096 /* bytes summed right after their runs are written, while they are in the core's cache */

/* Reads the next run of a checked piece at *p into *run and, for a run (not the piece's closing 0), its gap, which
 * advances *position (in bytes) to where the run starts. */
static inline __attribute__((always_inline)) void next_run(const unsigned char **p, const unsigned char *end,
                                                           uint64_t unit, uint64_t *run, uint64_t *position) {
    get_varint(p, end, run);
    if (*run != 0) {
        uint64_t gap = 0;
        get_varint(p, end, &gap);
        *position += gap * unit;
    }
}

/* Applies one piece's part of a checked encoding, starting at p; returns where the next piece's part starts. With
 * sum, adds the keyed sum of the piece's bytes once written, chunk by chunk as each chunk's runs are in. */
static inline __attribute__((always_inline)) const unsigned char *apply_piece(
    const unsigned char *p, const unsigned char *end, unsigned char *destination, uint64_t nbytes, uint64_t unit,
    uint64_t key, uint64_t *sum) {
    uint64_t run = 0, position = 0, summed = 0;
    next_run(&p, end, unit, &run, &position);
    for (;;) {
        uint64_t limit = nbytes - summed <= SUM_CHUNK ? nbytes : summed + SUM_CHUNK;
        /* The next chunk's lines are on their way while this one's runs are written: scattered writes otherwise
         * wait for each line in turn. */
        for (uint64_t ahead = limit; ahead < nbytes && ahead < limit + SUM_CHUNK; ahead += 64) {
            __builtin_prefetch(destination + ahead, 1, 3);
        }
        while (run != 0 && position < limit) {
            uint64_t n = run * unit;
            copy_run(destination + position, p, n);
            p += n;
            position += n;
            next_run(&p, end, unit, &run, &position);
        }
        if (sum != NULL) {
            *sum += keyed_sum(destination + summed, limit - summed, key + summed / 8 * KEY_STEP);
        }
        summed = limit;
        if (summed >= nbytes) {
            return p;
        }
    }
}

/* Applies one piece's part of a checked encoding, as apply_piece, to the ranges of the piece this receiver holds
 * (a worker that keeps its part alone: weightsync.core.delta.parts): segments is count pairs (end, held) that cover
 * the piece in order, every end but the last (nbytes) a multiple of 8. Bytes of runs outside held ranges are passed
 * over; with sum, adds the keyed sum of the held ranges once written, chunk by chunk as apply_piece does. */
static const unsigned char *apply_piece_held(const unsigned char *p, const unsigned char *end,
                                             unsigned char *destination, uint64_t nbytes, uint64_t unit,
                                             uint64_t key, const uint64_t *segments, uint64_t count,
                                             uint64_t *sum) {
    uint64_t run = 0, position = 0, summed = 0, segment = 0, summing = 0;
    next_run(&p, end, unit, &run, &position);
    for (;;) {
        uint64_t limit = nbytes - summed <= SUM_CHUNK ? nbytes : summed + SUM_CHUNK;
        while (run != 0 && position < limit) {
            uint64_t stop = position + run * unit;
            for (uint64_t at = position; at < stop;) { /* the run's bytes inside each held range */
                while (segment < count && segments[2 * segment] <= at) {
                    segment++;
                }
                if (segment >= count) { /* not reached: checked runs lie inside the piece, which they cover */
                    break;
                }
                uint64_t upto = segments[2 * segment] < stop ? segments[2 * segment] : stop;
                if (segments[2 * segment + 1]) {
                    copy_run(destination + at, p + (at - position), upto - at);
                }
                at = upto;
            }
            p += stop - position;
            position = stop;
            next_run(&p, end, unit, &run, &position);
        }
        if (sum != NULL) { /* the held ranges' bytes of this chunk, every run in it written */
            uint64_t start = summing == 0 ? 0 : segments[2 * (summing - 1)];
            for (; summing < count; start = segments[2 * summing], summing++) {
                uint64_t low = start > summed ? start : summed;
                uint64_t high = segments[2 * summing] < limit ? segments[2 * summing] : limit;
                if (segments[2 * summing + 1] && high > low) {
                    *sum += keyed_sum(destination + low, high - low, key + low / 8 * KEY_STEP);
                }
                if (segments[2 * summing] > limit) {
                    break; /* the rest of this range is summed with the next chunk */
                }
            }
        }
        summed = limit;
        if (summed >= nbytes) {
            return p;
        }
    }
}

/* pieces: count rows of (destination address, nbytes, unit, key), as the encoding's pieces. Checks the whole
 * encoding first and writes nothing unless it is well formed (every run inside its piece, nothing left over):
 * returns 0 after applying it, -1 for a malformed one. With sum (not NULL), *sum gets the keyed sum of the pieces'
 * bytes once applied (key: of a piece's first word), computed in the same pass. With held (not NULL), only the
 * ranges each piece's row there names are written and summed: for each piece in order, a count n and n pairs
 * (end, held) as apply_piece_held takes them. */
int weightsync_delta_apply(const unsigned char *delta, uint64_t length, const uint64_t *pieces, size_t count,
                           uint64_t *sum, const uint64_t *held) {
    if (check_delta(delta, length, pieces, count) != 0) {
        return -1;
    }
    const unsigned char *p = delta, *end = delta + length;
    uint64_t total = 0;
    for (size_t i = 0; i < count; i++, pieces += 4) {
        unsigned char *destination = (unsigned char *)(uintptr_t)pieces[0];
        uint64_t *into = sum == NULL ? NULL : &total;
        if (held != NULL) {
            p = apply_piece_held(p, end, destination, pieces[1], pieces[2], pieces[3], held + 1, held[0], into);
            held += 1 + 2 * held[0];
            continue;
        }
        switch (pieces[2]) { /* inlined for each unit, as encode_piece */
        case 1: p = apply_piece(p, end, destination, pieces[1], 1, pieces[3], into); break;
        case 2: p = apply_piece(p, end, destination, pieces[1], 2, pieces[3], into); break;
        case 4: p = apply_piece(p, end, destination, pieces[1], 4, pieces[3], into); break;
        default: p = apply_piece(p, end, destination, pieces[1], 8, pieces[3], into); break;
        }
    }
    if (sum != NULL) {
        *sum = total;
    }
    return 0;
}
