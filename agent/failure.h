// What a failed worker left behind (its TORCHELASTIC_ERROR_FILE) and the summary ddplaunch
// prints when the job fails, in the shape of torchrun's ChildFailedError message.
#pragma once

#include <string>
#include <vector>

#include "rendezvous/types.h"

namespace ddp::agent {

// The content of an error file written by PyTorch's @record (ErrorHandler): either
// {"message": {"message": M, "extraInfo": {"py_callstack": T, "timestamp": "S"}}} or
// {"message": M, "timestamp": S}.
struct ErrorFileContent {
  bool present = false;   // the file existed and parsed
  std::string message;    // M
  std::string traceback;  // T (empty in the string form)
  double timestamp = 0;   // S, seconds since the epoch (0 when absent)
  std::string problem;    // why it could not be read, when it existed but did not parse
};

ErrorFileContent parse_error_file(const std::string& text);
// Reads and parses `path`; present == false when the file does not exist.
ErrorFileContent read_error_file(const std::string& path);

// "SIGSEGV" for 11; "signal 99" when unknown.
std::string signal_name(int signo);

// One failed worker as observed on this node.
struct LocalFailure {
  rdzv::WorkerFailure failure;
  std::string error_file;  // path, empty when the worker wrote none
  std::vector<std::string> log_files;  // its stdout.log / stderr.log under --redirects or --tee
};

// Root cause first, then the others, as torchrun prints them. `title` names the program.
std::string format_failure_summary(const std::string& title, const rdzv::WorkerFailure& root,
                                   const std::string& root_error_file,
                                   const std::vector<LocalFailure>& others,
                                   const std::vector<std::string>& root_log_files = {});

// WorkerFailure.error_file_message from an error file's content: the message, then the
// traceback when there is one.
std::string summarise_error_file(const ErrorFileContent& content);

}  // namespace ddp::agent
