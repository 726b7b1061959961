package dev.sidecar.spring;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.client.SidecarClientBuilder;
import io.micrometer.core.instrument.binder.grpc.ObservationGrpcClientInterceptor;
import io.micrometer.observation.ObservationRegistry;
import java.nio.file.Path;
import org.springframework.ai.model.SpringAIModelProperties;
import org.springframework.beans.factory.ObjectProvider;
import org.springframework.boot.health.autoconfigure.contributor.ConditionalOnEnabledHealthIndicator;
import org.springframework.boot.health.contributor.HealthIndicator;
import org.springframework.boot.autoconfigure.AutoConfiguration;
import org.springframework.boot.autoconfigure.condition.ConditionalOnBean;
import org.springframework.boot.autoconfigure.condition.ConditionalOnClass;
import org.springframework.boot.autoconfigure.condition.ConditionalOnMissingBean;
import org.springframework.boot.autoconfigure.condition.ConditionalOnProperty;
import org.springframework.boot.context.properties.EnableConfigurationProperties;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Configuration;

/**
 * Auto-configures a {@link SidecarClient} from {@code sidecar.client.*}, the Spring AI
 * {@link SidecarChatModel} and {@link SidecarEmbeddingModel} (selected unless
 * {@code spring.ai.model.chat} / {@code spring.ai.model.embedding} name another
 * provider), an actuator health indicator and gRPC client observation. Every bean backs
 * off when the application defines its own. Runs before Spring AI's ChatClient
 * auto-configuration, whose {@code ChatClient.Builder} then wraps the chat model.
 */
@AutoConfiguration(
        afterName = "org.springframework.boot.micrometer.observation.autoconfigure.ObservationAutoConfiguration",
        beforeName = "org.springframework.ai.model.chat.client.autoconfigure.ChatClientAutoConfiguration")
@ConditionalOnClass(SidecarClient.class)
@EnableConfigurationProperties(SidecarProperties.class)
public class SidecarAutoConfiguration {

    @Bean(destroyMethod = "close")
    @ConditionalOnMissingBean
    public SidecarClient sidecarClient(SidecarProperties props, ObjectProvider<SidecarClientCustomizer> customizers) {
        SidecarClientBuilder b = SidecarClient.builder()
                .target(props.getTarget())
                .apiKey(props.getApiKey())
                .tls(props.isTls())
                .maxRetryAttempts(props.getMaxRetryAttempts())
                .maxInboundMessageSize(maxMessageBytes(props));
        if (props.getDeadline() != null && !props.getDeadline().isZero()) {
            b.defaultDeadline(props.getDeadline());
        }
        if (props.getTrustCertificates() != null && !props.getTrustCertificates().isBlank()) {
            b.trustedCertificates(Path.of(props.getTrustCertificates()));
        }
        customizers.orderedStream().forEach(c -> c.customize(b));
        return b.build();
    }

    private static int maxMessageBytes(SidecarProperties props) {
        long bytes = props.getMaxMessageSize() == null ? -1 : props.getMaxMessageSize().toBytes();
        if (bytes <= 0 || bytes > Integer.MAX_VALUE) {
            throw new IllegalArgumentException(SidecarProperties.PREFIX
                    + ".max-message-size: must be between 1B and 2GB, got " + props.getMaxMessageSize());
        }
        return (int) bytes;
    }

    @Bean
    @ConditionalOnMissingBean
    @ConditionalOnProperty(name = SpringAIModelProperties.CHAT_MODEL, havingValue = SidecarChatModel.PROVIDER,
            matchIfMissing = true)
    public SidecarChatModel sidecarChatModel(SidecarClient client, SidecarProperties props,
                                             ObjectProvider<ObservationRegistry> observationRegistry) {
        return new SidecarChatModel(client, props.getChat().toOptions(),
                observationRegistry.getIfUnique(() -> ObservationRegistry.NOOP));
    }

    @Bean
    @ConditionalOnMissingBean
    @ConditionalOnProperty(name = SpringAIModelProperties.EMBEDDING_MODEL, havingValue = SidecarChatModel.PROVIDER,
            matchIfMissing = true)
    public SidecarEmbeddingModel sidecarEmbeddingModel(SidecarClient client) {
        return new SidecarEmbeddingModel(client);
    }

    /** Observes every gRPC call of the client (timer + trace span per RPC). */
    @Configuration(proxyBeanMethods = false)
    @ConditionalOnClass({ObservationGrpcClientInterceptor.class, ObservationRegistry.class})
    @ConditionalOnBean(ObservationRegistry.class)
    static class ObservationConfiguration {

        @Bean
        SidecarClientCustomizer sidecarObservationCustomizer(ObservationRegistry registry) {
            return builder -> builder.interceptor(new ObservationGrpcClientInterceptor(registry));
        }
    }

    @Configuration(proxyBeanMethods = false)
    @ConditionalOnClass({HealthIndicator.class, ConditionalOnEnabledHealthIndicator.class})
    @ConditionalOnEnabledHealthIndicator("sidecar")
    static class HealthConfiguration {

        @Bean
        @ConditionalOnMissingBean(name = "sidecarHealthIndicator")
        SidecarHealthIndicator sidecarHealthIndicator(SidecarClient client, SidecarProperties props) {
            return new SidecarHealthIndicator(client, props.getHealthTimeout());
        }
    }
}
