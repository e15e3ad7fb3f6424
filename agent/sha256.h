// SHA-256 of bytes and files (OpenSSL's EVP), as lowercase hex. Any thread.
#pragma once

#include <string>
#include <string_view>

#include "rendezvous/error.h"

namespace ddp::agent {

// SHA-256 as 64 lowercase hex digits.
std::string sha256_hex(std::string_view data);
// SHA-256 of a file's contents, or why not ("hash PATH: <errno text>") when it cannot be read.
Expected<std::string> sha256_file(const std::string& path);

}  // namespace ddp::agent
