// CRC-32C (Castagnoli), used for checkpoint checksums. Uses the SSE4.2 instruction when the
// CPU has it (checked at run time), slicing-by-8 tables otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddp {

// Continues a CRC: crc32c(b, crc32c(a)) == crc32c(a + b). Start with 0.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

// The same value computed by the portable table code (slicing-by-8) that crc32c() uses when
// the CPU has no SSE4.2; exposed so tests can compare both paths.
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);

}  // namespace ddp
