// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A small JSON reader for the tests (objects, arrays, strings, numbers, true/false/null): enough to
// parse the trace files meshlib writes back and check their structure. Throws std::runtime_error
// with the offset on malformed input, so a broken file fails the test with a reason.
#pragma once
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace json_lite {

struct value {
  enum class kind { null, boolean, number, string, array, object } k = kind::null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<value> arr;
  std::map<std::string, value> obj;

  [[nodiscard]] bool has(const std::string& key) const { return k == kind::object && obj.count(key) != 0; }
  [[nodiscard]] const value& operator[](const std::string& key) const {
    auto it = obj.find(key);
    if (k != kind::object || it == obj.end()) throw std::runtime_error("json: no key '" + key + "'");
    return it->second;
  }
};

class parser {
 public:
  explicit parser(std::string_view s) : s_(s) {}
  value parse() {
    value v = any();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("json: " + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  value any() {
    const char c = peek();
    if (c == '{') return object();
    if (c == '[') return array();
    if (c == '"') {
      value v;
      v.k = value::kind::string;
      v.str = string();
      return v;
    }
    if (s_.substr(i_, 4) == "true" || s_.substr(i_, 5) == "false") {
      value v;
      v.k = value::kind::boolean;
      v.b = s_[i_] == 't';
      i_ += v.b ? 4 : 5;
      return v;
    }
    if (s_.substr(i_, 4) == "null") {
      i_ += 4;
      return value{};
    }
    const std::string rest(s_.substr(i_, 64));
    char* end = nullptr;
    const double d = std::strtod(rest.c_str(), &end);
    if (end == rest.c_str()) fail("bad value");
    i_ += static_cast<std::size_t>(end - rest.c_str());
    value v;
    v.k = value::kind::number;
    v.num = d;
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("bad escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u':
          if (i_ + 4 > s_.size()) fail("bad \\u escape");
          out += static_cast<char>(std::strtol(std::string(s_.substr(i_, 4)).c_str(), nullptr, 16));
          i_ += 4;
          break;
        default: fail("bad escape");
      }
    }
  }
  value array() {
    expect('[');
    value v;
    v.k = value::kind::array;
    if (peek() == ']') {
      ++i_;
      return v;
    }
    while (true) {
      v.arr.push_back(any());
      if (peek() == ',') {
        ++i_;
        continue;
      }
      expect(']');
      return v;
    }
  }
  value object() {
    expect('{');
    value v;
    v.k = value::kind::object;
    if (peek() == '}') {
      ++i_;
      return v;
    }
    while (true) {
      peek();
      std::string key = string();
      expect(':');
      v.obj[key] = any();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      expect('}');
      return v;
    }
  }
  std::string_view s_;
  std::size_t i_ = 0;
};

inline value parse(std::string_view s) { return parser(s).parse(); }

}  // namespace json_lite
