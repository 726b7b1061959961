package dev.sidecar.demo;

import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.boot.context.properties.ConfigurationPropertiesScan;

/** Chat API over the sidecar: {@code POST /api/chat/message} and {@code POST /api/chat/stream}. */
@SpringBootApplication
@ConfigurationPropertiesScan
public class ChatDemoApplication {

    public static void main(String[] args) {
        SpringApplication.run(ChatDemoApplication.class, args);
    }
}
