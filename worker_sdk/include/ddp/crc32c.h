// CRC-32C (Castagnoli), used for checkpoint checksums. Uses the SSE4.2 instruction when the
// CPU has it, a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddp {

// Continues a CRC: crc32c(b, crc32c(a)) == crc32c(a + b). Start with 0.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace ddp
