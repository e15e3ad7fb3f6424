// ddp-sentinel: the sentinel of agent/containment.h as a program of its own, so that the agent
// can spawn it without copying its memory (agent/sentinel.h). Started by the agent only:
//   ddp-sentinel <read fd> <cgroup dir, or empty> <marker entry NAME=value>
// Linked statically and small, so that starting it costs little.
#include <fcntl.h>

#include <cstdlib>
#include <cstring>

#include "agent/sentinel.h"

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  char* end = nullptr;
  const long fd = std::strtol(argv[1], &end, 10);
  if (end == argv[1] || *end != '\0' || fd < 0 || fd > 1 << 30) return 2;
  if (std::strchr(argv[3], '=') == nullptr) return 2;
  // Without the pipe, end of file would never mean that the agent is gone: refuse to start.
  if (::fcntl(static_cast<int>(fd), F_GETFD) < 0) return 2;
  ddp::agent::sentinel_main(static_cast<int>(fd), argv[2], argv[3]);
}
