#include "agent/policy.h"

#include <sstream>

namespace ddp::agent {

std::string seconds_text(double seconds) {
  std::ostringstream os;
  os << seconds;
  return os.str();
}

std::string tenths(double seconds) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(seconds < 100 ? 1 : 0);
  os << seconds;
  return os.str();
}

}  // namespace ddp::agent
