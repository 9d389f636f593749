// printable_text(): bytes read from a file someone else can write (the history's tracker, the lock
// file's holder line), made safe to quote in a message. Written raw, a control character or an
// escape sequence in them would reach the user's terminal, and a long text would bury the message.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mxddp::ckpt {

// The first max_bytes bytes of text with \n, \r, \t, \\ and every byte outside printable ASCII
// (0x20..0x7e) escaped (\xNN), then "... (N bytes)" when text is longer.
inline std::string printable_text(std::string_view text, size_t max_bytes = 64) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max_bytes; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c == '\\') out += "\\\\";
    else if (c < 0x20 || c > 0x7e) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  if (text.size() > max_bytes) out += fmt::format("... ({} bytes)", text.size());
  return out;
}

}  // namespace mxddp::ckpt
