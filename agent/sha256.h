// SHA-256 of bytes and files (OpenSSL's EVP), as lowercase hex. Any thread.
#pragma once

#include <string>
#include <string_view>

namespace ddp::agent {

// SHA-256 as 64 lowercase hex digits.
std::string sha256_hex(std::string_view data);
// SHA-256 of a file's contents. Throws std::system_error ("hash PATH: <errno text>") when it
// cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace ddp::agent
