// The one parser of ddplaunch's command line (launcher/command_line.h).
#include "launcher/command_line.h"

#include <algorithm>
#include <cstdlib>

#include "launcher/options.h"

namespace ddp::launcher {
namespace {

// An unknown option: the closest valid spellings when it looks like a typo of one; else it may
// be a PROGRAM whose name starts with '-', and then '--' is the way to say so.
[[noreturn]] void refuse_unknown(const std::string& token) {
  const std::string shown = token.substr(0, token.find('='));
  const std::vector<std::string> close =
      shown.compare(0, 2, "--") == 0 ? closest_long_options(shown.substr(2)) : std::vector<std::string>{};
  if (!close.empty()) {
    std::string list;
    for (std::size_t i = 0; i < close.size(); ++i) {
      list += (i == 0 ? "" : i + 1 == close.size() ? " or " : ", ") + close[i];
    }
    refuse("unknown option '" + shown + "'; did you mean " + list + "?");
  }
  refuse("unknown option '" + shown +
         "' (ddplaunch's options go before PROGRAM; put '--' before a PROGRAM whose name "
         "starts with '-')");
}

[[noreturn]] void refuse_missing_value(const std::string& token, const OptionSpec& spec) {
  refuse(token + " needs a value: " + token + "=" + spec.value_name + " (and then PROGRAM)");
}

const OptionSpec& long_option(const std::string& token, const std::string& name) {
  std::vector<std::string> candidates;
  const OptionSpec* spec = find_long_option(name, candidates);
  if (spec != nullptr) return *spec;
  if (candidates.empty()) refuse_unknown(token);
  std::string list;
  for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
  refuse("ambiguous option: --" + name + " could match " + list + "; write more of its name");
}

// Records one option occurrence. `value` is nullptr when the token carried none.
void take(CommandLine& line, const OptionSpec& spec, const std::string& token, const char* value,
          int argc, const char* const* argv, int& i) {
  const std::string name = spec.name;
  if (name == "help" || name == "version") {
    (name == "help" ? line.help : line.version) = true;
    return;
  }
  // Messages about the value name the option as written when that was an alias (--health_check).
  std::string source = std::string("--") + spec.name;
  if (token.compare(0, 2, "--") == 0) {
    const std::string written = token.substr(2, token.find('=') == std::string::npos ? std::string::npos
                                                                                     : token.find('=') - 2);
    for (const OptionAlias& a : option_aliases()) {
      if (written == a.alias || written == dash_spelling(a.alias)) source = "--" + written;
    }
  }
  if (spec.is_flag) {
    line.values.set(name, Given{value != nullptr ? value : "1", source});
    return;
  }
  if (value != nullptr) {
    // "--name=VALUE", also when VALUE is empty: it never swallows the next word.
    line.values.set(name, Given{value, source});
    return;
  }
  if (i + 1 >= argc) refuse_missing_value(token, spec);
  line.values.set(name, Given{argv[++i], source});
}

}  // namespace

CommandLine read_command_line(int argc, const char* const* argv) {
  CommandLine line;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string token = argv[i];
    if (token == "--") {
      ++i;
      break;
    }
    if (token.size() < 2 || token[0] != '-') break;  // PROGRAM
    if (token.compare(0, 2, "--") == 0) {
      const auto eq = token.find('=');
      const std::string name = token.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      const std::string value = eq == std::string::npos ? "" : token.substr(eq + 1);
      take(line, long_option(token, name), token, eq == std::string::npos ? nullptr : value.c_str(),
           argc, argv, i);
      continue;
    }
    const OptionSpec* spec = find_short_option(token[1]);
    if (spec == nullptr) refuse_unknown(token);
    if (spec->is_flag) {
      if (token.size() > 2) refuse_unknown(token);
      take(line, *spec, token, nullptr, argc, argv, i);
    } else if (token.size() > 2) {
      const std::string value = token.substr(token[2] == '=' ? 3 : 2);  // -r3, -r=3
      take(line, *spec, token, value.c_str(), argc, argv, i);
    } else {
      take(line, *spec, token, nullptr, argc, argv, i);
    }
  }
  line.program.assign(argv + std::min(i, argc), argv + argc);

  // PET_<NAME> for every option the command line left out; an empty variable counts as unset
  // (Kubeflow sets PET_STANDALONE="" and means "off").
  for (const OptionSpec& spec : option_table()) {
    if (line.values.find(spec.name) != nullptr) continue;
    const std::string variable = env_name(spec.name);
    const char* value = std::getenv(variable.c_str());
    if (value != nullptr && *value != '\0') line.values.set(spec.name, Given{value, variable});
  }
  return line;
}

}  // namespace ddp::launcher
