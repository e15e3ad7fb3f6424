// ddplaunch: parse the command line, build the agent, run the job (launcher/launch.h).
#include <cstdio>

#include "launcher/config.h"
#include "launcher/launch.h"

int main(int argc, char** argv) {
  try {
    const auto config = ddp::launcher::parse_command_line(argc, argv);
    return ddp::launcher::launch(config);
  } catch (const ddp::LaunchError& e) {
    // Messages come complete ("ddplaunch: ..."); --help and --version throw an empty one.
    if (*e.what()) std::fprintf(stderr, "%s\n", e.what());
    return e.exit_code();
  }
}
